"""Router overhead: kvgate vs calling one sim replica directly, side by side with a bare proxy and the SGLang gateway.

Starts ``kvgate sim --replicas 1 --time-scale 0`` (``--sim-time-scale``: 1 paces it like the engine it models, so a
stream's tokens arrive one by one) and, in front of it, kvgate (``kvgate serve``), a raw proxy on uvloop
and httptools protocols (the floor any Python proxy pays), a bare FastAPI + aiohttp proxy (the common Python stack),
and the SGLang Model Gateway (``sglang_router``, cache_aware) when it is importable. The driver (this process, aiohttp) sends the same requests to each target in turn, per scenario:
2,000- and 100,000-character prompts (a shared document plus a per-request question, so kvgate's tokenizer cache is
warm the way a growing chat or a shared document keeps it), streaming and not, at concurrency 1 and 64.

Printed per target and scenario: median and p99 latency, added median vs direct, requests/s, the target process's
CPU time per request (utime+stime of its whole process group from /proc, so tokenizer threads and Rust workers
count), and for streams the median TTFT and the largest gap between chunks (a Nagle / delayed-ACK stall shows as
~40 ms). First, each target's idle CPU (ms per second with no traffic: health checks, /metrics scrapes, KV-event
subscriptions), which is not part of the per-request numbers' story but is spent all the same.

``--compare-tree DIR`` adds a second kvgate run from another source tree, from that tree's own ``.venv`` (e.g.
``git worktree add /tmp/old HEAD~3`` and ``/tmp/old/dev.sh kvgate --help`` once to make it), so a change is measured
against its predecessor side by side in one run on a noisy machine.
``--policy NAME`` (repeatable) adds kvgate routing with that policy (``round_robin``: the request path without the
cost model's decision) beside kvgate with the policy file's default.
``--traced`` adds kvgate with tracing on (every request sampled, spans exported over OTLP/HTTP to a sink this
script runs, which answers every export at once): tracing's cost, paired round by round against kvgate untraced.
``--rounds N`` runs every target N times per scenario in a rotated order and reports medians, plus kvgate's CPU per
request above the bare proxy (and above the ``--compare-tree`` kvgate) paired round by round: single runs on a shared
2-core machine vary by ~0.2 ms.
``--output-tokens N`` asks every request for N tokens instead of 16: a stream's relay, one chunk per token.
Run by hand: ``.venv/bin/python benchmarks/bench_overhead.py [--quick] [--rounds N] [--chars 2000] [--compare-tree DIR]
[--policy NAME] [--traced] [--output-tokens N]``.
"""


import argparse
import asyncio
import importlib.util
import os
import statistics
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.loadgen.bench import KVGATE, apply_settings, free_port_block
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm

MODEL = "kvgate-sim"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the bare proxy baseline (run as a subprocess: `bench_overhead.py bare-proxy --port P --upstream URL`) --------


def run_bare_proxy(port: int, upstream: str) -> None:
    """The least a FastAPI + aiohttp proxy can do: forward the body, relay the answer (streamed when it is SSE)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from starlette.responses import Response, StreamingResponse

    app = FastAPI()
    state: dict[str, aiohttp.ClientSession] = {}

    @app.on_event("startup")
    async def startup() -> None:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit_per_host=256))

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        resp = await state["session"].post(f"{upstream}/v1/{path}", data=body,
                                           headers={"content-type": "application/json"})
        if resp.content_type == "text/event-stream":
            async def relay():  # type: ignore[no-untyped-def]
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()

            return StreamingResponse(relay(), status_code=resp.status, media_type="text/event-stream")
        data = await resp.read()
        return Response(data, status_code=resp.status, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning")


def run_raw_proxy(port: int, upstream: str) -> None:
    """The least any Python proxy costs: uvloop and httptools protocols on both sides, no framework, no parsing of
    the body, keep-alive connections to the upstream reused most recent first, answers relayed chunk by chunk as
    they arrive (chunked to the client). Nothing a gateway needs beyond that: the floor, not a gateway."""
    import collections

    import httptools
    import uvloop

    host, _, upstream_port = upstream.removeprefix("http://").partition(":")

    class Upstream(asyncio.Protocol):
        def __init__(self, idle: collections.deque) -> None:
            self.idle = idle
            self.parser = httptools.HttpResponseParser(self)
            self.client: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_headers_complete(self) -> None:
            assert self.client is not None
            self.client.write(b"HTTP/1.1 %d OK\r\ntransfer-encoding: chunked\r\n\r\n" % self.parser.get_status_code())

        def on_body(self, body: bytes) -> None:
            assert self.client is not None
            self.client.write(b"%x\r\n%b\r\n" % (len(body), body))

        def on_message_complete(self) -> None:
            assert self.client is not None
            self.client.write(b"0\r\n\r\n")
            self.client = None
            self.idle.append(self)

    idle: collections.deque[Upstream] = collections.deque()

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_begin(self) -> None:
            self.url, self.body = b"", []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            asyncio.get_running_loop().create_task(self.forward(self.url, b"".join(self.body)))

        async def forward(self, url: bytes, body: bytes) -> None:
            if idle:
                up = idle.pop()
            else:
                _, up = await asyncio.get_running_loop().create_connection(
                    lambda: Upstream(idle), host, int(upstream_port))
            up.client = self.transport
            up.transport.write(b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n"
                               b"content-length: %d\r\n\r\n%b" % (url, host.encode(), len(body), body))

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


def run_otlp_sink(port: int) -> None:
    """A collector that takes every OTLP/HTTP export and keeps nothing: what kvgate pays to export, not a
    collector's own cost."""
    from aiohttp import web

    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", accept)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- targets -----------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    process: ChildProcess | None

    def cpu_seconds(self) -> float:
        """utime + stime of every process in the target's process group (0 for the direct target)."""
        if self.process is None:
            return 0.0
        pgid = self.process.pid
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:  # pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / CLK_TCK


def start_targets(
    tmp: Path, with_sglang: bool, compare_tree: Path | None, traced: bool = False, policies: list[str] | None = None,
    sim_time_scale: float = 0.0,
) -> tuple[list[ChildProcess], list[Target]]:
    """The targets, direct first, and the processes behind them that are not measured (the sim, the OTLP sink)."""
    sim_port, zmq_port = free_port_block(1), free_port_block(2)
    fleet = tmp / "fleet.yaml"
    sim = ChildProcess(
        "kvgate sim", [*KVGATE, "sim", "--replicas", "1", "--port", str(sim_port), "--zmq-port", str(zmq_port), "--time-scale", str(sim_time_scale),
         "--max-model-len", "200000", "--kv-blocks", "32768", "--write-config", str(fleet)],
        tmp / "sim.log",
    ).start()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim.wait_http(sim_url + "/health", 60)
    targets = [Target("direct", sim_url, None)]
    background = [sim]

    raw_port = free_port_block(1)
    raw = ChildProcess("raw proxy", [sys.executable, __file__, "raw-proxy", "--port", str(raw_port), "--upstream",
                       sim_url], tmp / "raw.log").start()
    targets.append(Target("raw-proxy", f"http://127.0.0.1:{raw_port}", raw))

    bare_port = free_port_block(1)
    bare = ChildProcess("bare proxy", [sys.executable, __file__, "bare-proxy", "--port", str(bare_port), "--upstream",
                        sim_url], tmp / "bare.log").start()
    targets.append(Target("bare-proxy", f"http://127.0.0.1:{bare_port}", bare))

    kv_port = free_port_block(1)
    kvgate = ChildProcess("kvgate", [*KVGATE, "serve", "--config", str(fleet), "--port", str(kv_port)],
                          tmp / "kvgate.log").start()  # as deployed: one JSON log line per request
    targets.append(Target("kvgate", f"http://127.0.0.1:{kv_port}", kvgate))

    for policy in policies or []:
        config = tmp / f"fleet-{policy}.yaml"
        config.write_text(fleet.read_text())
        apply_settings(config, [f"policy.name={policy}"])
        port = free_port_block(1)
        process = ChildProcess(f"kvgate {policy}", [*KVGATE, "serve", "--config", str(config), "--port", str(port)],
                               tmp / f"kvgate-{policy}.log").start()
        targets.append(Target(f"kvgate:{policy}", f"http://127.0.0.1:{port}", process))

    if traced:
        sink_port, traced_port = free_port_block(1), free_port_block(1)
        sink = ChildProcess("otlp sink", [sys.executable, __file__, "otlp-sink", "--port", str(sink_port)],
                            tmp / "otlp-sink.log").start()
        sink.wait_http(f"http://127.0.0.1:{sink_port}/v1/traces", 60, ready=lambda status: True)
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces",
               "OTEL_TRACES_SAMPLER": "always_on"}
        kv_traced = ChildProcess("kvgate traced",
                                 [*KVGATE, "serve", "--config", str(fleet), "--port", str(traced_port)],
                                 tmp / "kvgate-traced.log", env=env).start()
        targets.append(Target("kvgate+traces", f"http://127.0.0.1:{traced_port}", kv_traced))
        background.append(sink)

    if compare_tree is not None:
        old_port = free_port_block(1)
        # The other tree runs from its own environment (`./dev.sh` there makes it), whatever its import layout.
        old = ChildProcess("kvgate (compared)", [str(compare_tree / ".venv" / "bin" / "kvgate"), "serve", "--config",
                           str(fleet), "--port", str(old_port)], tmp / "kvgate-compare.log").start()
        targets.append(Target(f"kvgate@{compare_tree.name}", f"http://127.0.0.1:{old_port}", old))

    if with_sglang:
        sg_port, sg_metrics = free_port_block(1), free_port_block(1)
        sglang = ChildProcess(
            "sglang gateway", [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", sim_url, "--policy", "cache_aware",
             "--host", "127.0.0.1", "--port", str(sg_port), "--prometheus-port", str(sg_metrics), "--log-level",
             "error"],
            tmp / "sglang.log",
        ).start()
        targets.append(Target("sglang-gateway", f"http://127.0.0.1:{sg_port}", sglang))
    try:
        for t in targets[1:]:
            assert t.process is not None
            if t.name in ("bare-proxy", "raw-proxy"):  # they serve POSTs only: any answer means one is up
                t.process.wait_http(t.url + "/v1/models", 60, ready=lambda status: True)
            else:
                t.process.wait_http(t.url + "/v1/models" if t.name != "sglang-gateway" else t.url + "/health", 60)
    except BaseException:  # a target that never came up: stop every process started, not only the ones measured
        for t in targets[1:]:
            assert t.process is not None
            t.process.stop()
        for process in background:
            process.stop()
        raise
    return background, targets


# --- the driver --------------------------------------------------------------------------------------------------


@dataclass
class Result:
    latencies_ms: list[float]
    ttfts_ms: list[float]
    max_gap_ms: float
    wall_s: float
    cpu_s: float
    errors: int


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> tuple[float, float, float]:
    started = time.perf_counter()
    first = 0.0
    max_gap = 0.0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        if stream:
            last = None
            async for _ in resp.content.iter_any():
                now = time.perf_counter()
                if last is None:
                    first = now - started
                else:
                    max_gap = max(max_gap, now - last)
                last = now
        else:
            await resp.read()
    return (time.perf_counter() - started) * 1000.0, first * 1000.0, max_gap * 1000.0


async def drive(
    target: Target, document: str, stream: bool, concurrency: int, requests: int, output_tokens: int = 16,
) -> Result:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        def body(i: int) -> dict:
            return {"model": MODEL, "prompt": f"{document}\nQuestion {i}: what follows?", "max_tokens": output_tokens,
                    "stream": stream}

        for i in range(min(20, requests)):  # warm connections and caches
            await one_request(session, target.url, body(-i - 1), stream)
        queue = iter(range(requests))
        latencies: list[float] = []
        ttfts: list[float] = []
        gaps: list[float] = []
        errors = 0

        async def worker() -> None:
            nonlocal errors
            for i in queue:
                try:
                    latency, ttft, gap = await one_request(session, target.url, body(i), stream)
                except Exception:
                    errors += 1
                    continue
                latencies.append(latency)
                ttfts.append(ttft)
                gaps.append(gap)

        cpu0 = target.cpu_seconds()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = target.cpu_seconds() - cpu0
    return Result(latencies, ttfts, max(gaps) if gaps else 0.0, wall, cpu, errors)


IDLE_SECONDS = 10.0


async def idle_cpu_ms_per_s(targets: list[Target], seconds: float) -> dict[str, float]:
    """CPU each target spends per second with no traffic (all measured over the same seconds). The clock tick is
    10 ms, hence the long window."""
    measured = [t for t in targets if t.process is not None]
    await asyncio.sleep(1.0)  # let startup work (first probes, subscriptions) settle
    before = [t.cpu_seconds() for t in measured]
    await asyncio.sleep(seconds)
    return {t.name: (t.cpu_seconds() - b) * 1000.0 / seconds for t, b in zip(measured, before)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def make_document(chars: int) -> str:
    """Text of ``chars`` characters in paragraphs of ~800 (documents have paragraph breaks; kvgate's tokenizer cache
    splits long text at them)."""
    words = "the router keeps every cached prefix warm while replicas share the load fairly".split()
    out: list[str] = []
    size = 0
    i = 0
    while size < chars:
        w = words[i % len(words)] + str(i % 97)
        out.append(w + ("\n\n" if i % 110 == 109 else " "))
        size += len(out[-1])
        i += 1
    return "".join(out)[:chars]


async def main_async(args: argparse.Namespace) -> None:
    with_sglang = importlib.util.find_spec("sglang_router") is not None and not args.no_sglang
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        background, targets = start_targets(Path(tmp), with_sglang, args.compare_tree, args.traced, args.policy,
                                            args.sim_time_scale)
        try:
            idle = await idle_cpu_ms_per_s(targets, IDLE_SECONDS)
            print("idle CPU ms/s: " + ", ".join(f"{name} {ms:.1f}" for name, ms in idle.items()))
            scale = 0.25 if args.quick else 1.0
            scenarios = [
                (2_000, False, 1, 400), (2_000, True, 1, 400), (2_000, False, 64, 3000), (2_000, True, 64, 3000),
                (100_000, False, 1, 60), (100_000, True, 1, 60), (100_000, False, 64, 200), (100_000, True, 64, 200),
            ]
            print(f"targets: {', '.join(t.name for t in targets)}"
                  + ("" if with_sglang else "  (SGLang gateway skipped: --no-sglang, or sglang_router not importable)"))
            header = (f"{'chars':>7} {'stream':>6} {'conc':>4}  {'target':<20}{'p50 ms':>8}{'p99 ms':>8}{'added':>8}"
                      f"{'req/s':>8}{'cpu/req ms':>11}{'ttft ms':>9}{'max gap':>8}{'err':>5}")
            print(header)
            for chars, stream, concurrency, n in scenarios:
                if args.chars and chars not in args.chars:
                    continue
                if args.concurrency and concurrency not in args.concurrency:
                    continue
                if args.stream is not None and stream != (args.stream == "yes"):
                    continue
                document = make_document(chars)
                rounds: dict[str, list[Result]] = {t.name: [] for t in targets}
                for k in range(args.rounds):  # each round runs every target, starting one later each time
                    for target in targets[k % len(targets):] + targets[: k % len(targets)]:
                        rounds[target.name].append(
                            await drive(target, document, stream, concurrency, max(20, int(n * scale)),
                                        args.output_tokens)
                        )
                direct = statistics.median(lat for r in rounds["direct"] for lat in r.latencies_ms)
                cpu: dict[str, list[float]] = {}
                for name, results in rounds.items():
                    latencies = [lat for r in results for lat in r.latencies_ms]
                    done = len(latencies)
                    p50 = statistics.median(latencies) if done else float("nan")
                    cpu[name] = [r.cpu_s / len(r.latencies_ms) * 1000.0 for r in results if r.latencies_ms]
                    cpu_req = statistics.median(cpu[name]) if cpu[name] and name != "direct" else float("nan")
                    rate = statistics.median(len(r.latencies_ms) / r.wall_s for r in results)
                    ttfts = [t for r in results for t in r.ttfts_ms]
                    ttft = statistics.median(ttfts) if stream and done else float("nan")
                    gap = max(r.max_gap_ms for r in results)
                    print(f"{chars:>7} {str(stream):>6} {concurrency:>4}  {name:<20}{p50:>8.2f}"
                          f"{percentile(latencies, 0.99):>8.2f}{p50 - direct:>8.2f}{rate:>8.0f}"
                          f"{cpu_req:>11.3f}{ttft:>9.2f}{gap if stream else float('nan'):>8.1f}"
                          f"{sum(r.errors for r in results):>5}")
                if args.rounds > 1 and cpu.get("kvgate") and cpu.get("bare-proxy"):
                    diffs = sorted(k - b for k, b in zip(cpu["kvgate"], cpu["bare-proxy"]))
                    print(f"{'':>21}kvgate - bare-proxy CPU per request, paired by round: median "
                          f"{statistics.median(diffs):.3f} ms (range {diffs[0]:.3f} to {diffs[-1]:.3f})")
                for name in ["kvgate", *(f"kvgate:{policy}" for policy in args.policy or [])]:
                    if args.rounds > 1 and cpu.get(name) and cpu.get("sglang-gateway"):
                        ratios = sorted(k / g for k, g in zip(cpu[name], cpu["sglang-gateway"]) if g > 0)
                        if ratios:
                            print(f"{'':>21}{name} / sglang-gateway CPU per request, paired by round: median "
                                  f"{statistics.median(ratios):.2f}x (range {ratios[0]:.2f} to {ratios[-1]:.2f})")
                if args.rounds > 1 and cpu.get("kvgate+traces") and cpu.get("kvgate"):
                    diffs = sorted(t - k for t, k in zip(cpu["kvgate+traces"], cpu["kvgate"]))
                    print(f"{'':>21}kvgate+traces - kvgate CPU per request, paired by round: median "
                          f"{statistics.median(diffs):.3f} ms (range {diffs[0]:.3f} to {diffs[-1]:.3f})")
                compared = [name for name in cpu if name.startswith("kvgate@")]
                if args.rounds > 1 and compared and cpu.get("kvgate") and cpu.get(compared[0]):
                    diffs = sorted(k - o for k, o in zip(cpu["kvgate"], cpu[compared[0]]))
                    print(f"{'':>21}kvgate - {compared[0]} CPU per request, paired by round: median "
                          f"{statistics.median(diffs):.3f} ms (range {diffs[0]:.3f} to {diffs[-1]:.3f})")
                print()
        finally:
            for target in targets:
                if target.process is not None:
                    target.process.stop()
            for process in background:
                process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    for proxy in ("bare-proxy", "raw-proxy"):
        proxy_args = sub.add_parser(proxy)
        proxy_args.add_argument("--port", type=int, required=True)
        proxy_args.add_argument("--upstream", required=True)
    sink = sub.add_parser("otlp-sink")
    sink.add_argument("--port", type=int, required=True)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests per scenario")
    parser.add_argument("--no-sglang", action="store_true", help="skip the SGLang gateway even when installed")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every target this many times per scenario, in a rotated order each round; report "
                             "medians and kvgate's CPU per request above the bare proxy, paired by round")
    parser.add_argument("--chars", type=int, action="append", choices=(2_000, 100_000),
                        help="only scenarios with this prompt size (repeatable)")
    parser.add_argument("--concurrency", type=int, action="append", choices=(1, 64),
                        help="only scenarios at this concurrency (repeatable)")
    parser.add_argument("--stream", choices=("yes", "no"), default=None,
                        help="only the streamed scenarios, or only the ones answered whole")
    parser.add_argument("--output-tokens", type=int, default=16,
                        help="tokens each request asks for (default 16; a long stream relays one chunk per token)")
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="also run kvgate from this source tree's .venv (e.g. a git worktree of an older commit)")
    parser.add_argument("--policy", action="append",
                        help="also run kvgate with this routing policy (repeatable), e.g. round_robin")
    parser.add_argument("--sim-time-scale", type=float, default=0.0,
                        help="the sim's --time-scale (default 0: it answers at once; 1: at the modelled engine's pace, "
                             "a stream's tokens one by one)")
    parser.add_argument("--traced", action="store_true",
                        help="also run kvgate with tracing on, exporting every request's spans to a local OTLP sink")
    args = parser.parse_args()
    if args.mode == "bare-proxy":
        run_bare_proxy(args.port, args.upstream)
        return
    if args.mode == "raw-proxy":
        run_raw_proxy(args.port, args.upstream)
        return
    if args.mode == "otlp-sink":
        run_otlp_sink(args.port)
        return
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stopped by kill or timeout: stop what it started
    main()
