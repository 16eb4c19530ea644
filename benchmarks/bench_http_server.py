"""HTTP server cost alone: kvgate's own protocol against Granian and the floor, with no gateway behind them.

Each server reads a POST's body and answers a fixed JSON body of a completion's size, nothing else:
- ``kvgate``: kvgate's HTTP protocol (:mod:`kvgate.router.app.protocol`: httptools on uvloop, under uvicorn's server,
  with the policy file's default bounds and timeouts) and its route table, the endpoint reading the body with
  kvgate's own reader and answering with a Starlette ``Response``, as kvgate's endpoints do;
- ``granian``: Granian (Rust HTTP, RSGI interface, one worker, one runtime thread, uvloop), when importable
  (``pip install granian``), and ``granian-rust-tasks``, the same with Granian's Rust task implementation;
- ``raw``: a bare httptools protocol on uvloop that writes its answer in the parser's callback: the least a Python
  server costs.

The driver (this process, aiohttp, as in ``bench_overhead.py``) sends 2,000-character completions bodies at
concurrency 64 to each in turn, rotated per round, and prints each server's CPU per request (utime + stime of its
whole process group: Granian's Rust threads and worker count) and the paired differences. What a server framework
could save kvgate is at most its line here above ``raw``; compare it with kvgate's whole CPU per request in
``bench_overhead.py`` (docs/benchmarks.md, "Router overhead").

Run by hand, with nothing else on the machine: ``.venv/bin/python benchmarks/bench_http_server.py [--rounds N]
[--requests N]``.
"""

import argparse
import asyncio
import functools
import importlib.util
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from bench_overhead import Target, drive, make_document

from kvgate.loadgen.bench import free_port_block
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm

ANSWER = (b'{"id":"cmpl-1","object":"text_completion","model":"kvgate-sim","choices":[{"index":0,'
          b'"text":" the router keeps every cached prefix warm","finish_reason":"length"}],'
          b'"usage":{"prompt_tokens":512,"completion_tokens":16,"total_tokens":528}}')
SERVERS = ("raw", "kvgate", "granian", "granian-rust-tasks")


def serve_kvgate(port: int) -> None:
    import uvicorn
    import uvloop
    from starlette.responses import Response

    from kvgate.router.app.protocol import HttpProtocol
    from kvgate.router.app.routes import Routes
    from kvgate.router.core.config import ServerConfig
    from kvgate.router.core.http import HttpRequest
    from kvgate.router.pipeline.bodies import read_body

    bounds = ServerConfig()  # the policy file's defaults

    async def endpoint(request: HttpRequest) -> Response:
        await read_body(request, bounds.max_body_bytes, bounds.body_timeout_s, None)
        return Response(ANSWER, media_type="application/json", headers={"x-request-id": "bench"})

    routes = Routes()
    routes.add("POST", "/v1/completions", endpoint)
    protocol = functools.partial(
        HttpProtocol, routes=routes, header_timeout_s=bounds.header_timeout_s, body_timeout_s=bounds.body_timeout_s,
        max_header_bytes=bounds.max_header_bytes, max_headers=bounds.max_headers,
        keep_alive_s=bounds.keep_alive_timeout_s,
    )

    async def no_asgi_app(scope: object, receive: object, send: object) -> None:
        raise RuntimeError("served by the protocol")

    config = uvicorn.Config(no_asgi_app, host="127.0.0.1", port=port, ws="none", lifespan="off",
                            server_header=False, access_log=False, log_config=None)
    config.http = protocol  # type: ignore[assignment]  # uvicorn takes a protocol factory in place of a name
    uvloop.run(uvicorn.Server(config).serve())


async def rsgi_app(scope: object, protocol: object) -> None:
    """Granian's RSGI application: read the body, answer."""
    await protocol()  # type: ignore[operator]
    headers = [("content-type", "application/json"), ("x-request-id", "bench")]
    protocol.response_bytes(200, headers, ANSWER)  # type: ignore[attr-defined]


def serve_granian(port: int, rust_tasks: bool = False) -> None:
    from granian.constants import Interfaces, Loops, TaskImpl
    from granian.log import LogLevels
    from granian.server import Server

    Server("bench_http_server:rsgi_app", address="127.0.0.1", port=port, interface=Interfaces.RSGI, workers=1,
           runtime_threads=1, loop=Loops.uvloop, task_impl=TaskImpl.rust if rust_tasks else TaskImpl.asyncio,
           log_level=LogLevels.warning,
           working_dir=Path(__file__).resolve().parent).serve()


def serve_raw(port: int) -> None:
    import httptools
    import uvloop

    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: bench\r\ncontent-length: %d\r\n\r\n"

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            self.body.clear()
            self.transport.write(head % len(ANSWER) + ANSWER)  # type: ignore[attr-defined]

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


async def main_async(args: argparse.Namespace) -> None:
    has_granian = importlib.util.find_spec("granian") is not None
    names = [name for name in SERVERS if has_granian or not name.startswith("granian")]
    if not has_granian:
        print("granian is not importable: pip install granian to compare it")
    targets: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="bench-http-server-") as tmp:
        try:
            for name in names:
                port = free_port_block(1)
                process = ChildProcess(name, [sys.executable, __file__, "serve", name, "--port", str(port)],
                                       Path(tmp) / f"{name}.log").start()
                targets.append(Target(name, f"http://127.0.0.1:{port}", process))
                process.wait_http(f"{targets[-1].url}/v1/completions", 60, ready=lambda status: True)
            document = make_document(2000)
            cpu: dict[str, list[float]] = {t.name: [] for t in targets}
            for k in range(args.rounds):
                for target in targets[k % len(targets):] + targets[: k % len(targets)]:
                    result = await drive(target, document, False, 64, args.requests)
                    cpu[target.name].append(result.cpu_s / len(result.latencies_ms) * 1000.0)
            print(f"CPU ms per request, 2,000-character bodies, concurrency 64, {args.rounds} rounds:")
            for name, values in cpu.items():
                print(f"  {name:<18} median {statistics.median(values):.4f}  rounds "
                      + " ".join(f"{v:.4f}" for v in values))
            for name in names[1:]:
                diffs = sorted(a - b for a, b in zip(cpu[name], cpu["raw"]))
                print(f"  {name} - raw, paired by round: median {statistics.median(diffs):.4f} ms "
                      f"(range {diffs[0]:.4f} to {diffs[-1]:.4f})")
        finally:
            for target in targets:
                assert target.process is not None
                target.process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run one server (the driver starts these)")
    serve.add_argument("server", choices=SERVERS)
    serve.add_argument("--port", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5000, help="requests per server per round")
    args = parser.parse_args()
    if args.command == "serve":
        servers = {"raw": serve_raw, "kvgate": serve_kvgate, "granian": serve_granian,
                   "granian-rust-tasks": functools.partial(serve_granian, rust_tasks=True)}
        servers[args.server](args.port)
        return
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stopped by kill or timeout: stop what it started
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
