"""Overload without collapse: an interactive tenant beside a tenant flooding long documents, on a simulated fleet at
the engine's clock, with kvgate's admission, without it, and behind round robin, side by side with repeats.

Each run starts a fresh ``kvgate sim`` fleet (``--replicas``, time scale 1) and a fresh ``kvgate serve`` with two
tenants. The interactive tenant sends short chats on one shared system prompt (``--chat-rate`` per second); the
flooding tenant sends documents of ``--doc-tokens`` tokens, each a new one, at ``--flood-rate`` per second (about
twice what the fleet prefills). Both stream, through ``kvgate.loadgen``'s runner, for ``--duration`` seconds.

Runs per repeat, in a rotated order:

- ``alone``: the interactive tenant by itself (kvgate, cost policy, admission on);
- ``admission``: both tenants, admission on;
- ``no-admission``: both tenants, ``admission.enabled: false``;
- ``round-robin``: both tenants, the round_robin policy, admission off.

Printed per run and as medians over repeats (the lower middle one of an even count): the interactive tenant's TTFT
p50/p99/mean (at the client) and p99 on the sim's own clock (its engine queue and prefill alone), and how many of its
requests did not get a 200; the flooding tenant's goodput (answered requests per second, from the run's start to its
last answer), its refusals (429/503, and how many of them carried ``Retry-After``) and everything else it got
(timeouts, 5xx, other errors).
Run by hand: ``.venv/bin/python benchmarks/bench_admission.py [--repeats 3] [--duration 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvgate.loadgen.bench import KVGATE, free_port_block
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm
from kvgate.loadgen.runner import RequestRecord, RunConfig, run_workload
from kvgate.loadgen.workloads import synthetic
from kvgate.loadgen.workloads.request import WorkloadOptions

MODEL = "kvgate-sim"
KEYS = {"sk-chat": "chat", "sk-flood": "flood"}
RUNS = ("alone", "admission", "no-admission", "round-robin")


@dataclass
class Outcome:
    run: str
    chat_p50_ms: float
    chat_p99_ms: float
    chat_mean_ms: float
    chat_engine_p99_ms: float
    """The chats' TTFT p99 on the sim's own clock (its queue and prefill alone, free of this machine's CPU)."""
    chat_lost: int
    chat_sent: int
    flood_ok_per_s: float
    flood_refused: int
    flood_refused_with_retry_after: int
    flood_other_failures: int
    flood_sent: int


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def workloads(args: argparse.Namespace, seed: int) -> tuple[list[Any], list[Any]]:
    chats = int(args.chat_rate * args.duration)
    chat = synthetic.shared_prefix(WorkloadOptions(
        seed=seed, groups=1, prompts_per_group=chats, system_tokens=args.system_tokens, question_tokens=48,
        rate=args.chat_rate, output_tokens=16, requests=chats))
    floods = int(args.flood_rate * args.duration)
    low, high = (int(x) for x in args.doc_tokens.split(":"))
    flood = synthetic.documents(WorkloadOptions(
        seed=seed + 1, documents=floods, document_tokens=(low, high), zipf=0.0, requests=floods,
        rate=args.flood_rate, output_tokens=16, question_tokens=32))
    return chat, flood


def policy_file(sim_config: Path, out: Path, run: str, args: argparse.Namespace) -> Path:
    config = yaml.safe_load(sim_config.read_text())
    config["tenants"] = {"api_keys": KEYS, "salt_secret": "bench-admission-salt-secret"}
    config["policy"] = {"name": "round_robin" if run == "round-robin" else "cost"}
    admission: dict[str, Any] = {"enabled": run in ("alone", "admission")}
    if args.max_start_delay_ms is not None:
        admission["max_start_delay_ms"] = args.max_start_delay_ms
    if args.headroom is not None:
        admission["headroom"] = args.headroom
    config["admission"] = admission
    out.write_text(yaml.safe_dump(config))
    return out


async def one_run(run: str, args: argparse.Namespace, seed: int, tmp: Path) -> Outcome:
    http_port = free_port_block(args.replicas)
    zmq_port = free_port_block(2 * args.replicas)
    sim_config = tmp / f"fleet-{run}-{seed}.yaml"
    sim = ChildProcess("kvgate sim", [*KVGATE, "sim", "--replicas", str(args.replicas), "--port", str(http_port),
                                      "--zmq-port", str(zmq_port), "--time-scale", "1", "--write-config",
                                      str(sim_config)], tmp / f"sim-{run}-{seed}.log").start()
    gateway = None
    try:
        for i in range(args.replicas):
            sim.wait_http(f"http://127.0.0.1:{http_port + i}/health", 60)
        port = free_port_block(1)
        config = policy_file(sim_config, tmp / f"kvgate-{run}-{seed}.yaml", run, args)
        gateway = ChildProcess("kvgate serve", [*KVGATE, "serve", "--config", str(config), "--port", str(port)],
                               tmp / f"kvgate-{run}-{seed}.log").start()
        target = f"http://127.0.0.1:{port}"
        gateway.wait_http(target + "/health", 60)
        chat, flood = workloads(args, seed)
        common = {"target": target, "model": MODEL, "concurrency": 4096, "timeout_s": args.timeout,
                  "progress": False}
        runs = [run_workload(chat, RunConfig(**common, headers=(("Authorization", "Bearer sk-chat"),),
                                             id_prefix="chat"))]
        if run != "alone":
            runs.append(run_workload(flood, RunConfig(**common, headers=(("Authorization", "Bearer sk-flood"),),
                                                      id_prefix="flood")))
        results = await asyncio.gather(*runs)
        engine_ttft = engine_ttfts(http_port, args.replicas)
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
    chat_records = results[0][0]
    flood_records: list[RequestRecord] = results[1][0] if len(results) > 1 else []
    ttfts = [r.ttft_s * 1000.0 for r in chat_records if r.ok and r.ttft_s is not None]
    refused = [r for r in flood_records if r.status in (429, 503)]
    return Outcome(
        run=run,
        chat_p50_ms=percentile(ttfts, 0.50), chat_p99_ms=percentile(ttfts, 0.99),
        chat_mean_ms=statistics.fmean(ttfts) if ttfts else float("nan"),
        chat_engine_p99_ms=percentile([engine_ttft[r.request_id] for r in chat_records
                                       if r.ok and r.request_id in engine_ttft], 0.99),
        chat_lost=sum(not r.ok for r in chat_records), chat_sent=len(chat_records),
        flood_ok_per_s=served_per_s(flood_records),
        flood_refused=len(refused), flood_refused_with_retry_after=sum(r.retry_after is not None for r in refused),
        flood_other_failures=sum(not r.ok and r.status not in (429, 503) for r in flood_records),
        flood_sent=len(flood_records),
    )


def engine_ttfts(http_port: int, replicas: int) -> dict[str, float]:
    """Each request's TTFT on the sim's model clock, by request id (its replicas' /sim/requests)."""
    found: dict[str, float] = {}
    for i in range(replicas):
        entries = httpx.get(f"http://127.0.0.1:{http_port + i}/sim/requests", params={"limit": 100_000},
                            timeout=10.0).json()["requests"]
        for entry in entries:
            request_id, ttft = (entry.get("headers") or {}).get("x-request-id"), entry.get("ttft_ms")
            if isinstance(request_id, str) and isinstance(ttft, (int, float)):
                found[request_id] = float(ttft)
    return found


def served_per_s(records: list[RequestRecord]) -> float:
    """Answered requests per second from the first request's start to the last answer's end: the rate the fleet
    served them at (a run without admission finishes long after its last arrival)."""
    ok = [r for r in records if r.ok]
    if not ok:
        return 0.0
    span = max(r.end_s for r in ok) - min(r.start_s for r in records)
    return len(ok) / span if span > 0 else 0.0


def row(o: Outcome) -> str:
    return (f"{o.run:13} {o.chat_p50_ms:9.1f} {o.chat_p99_ms:9.1f} {o.chat_mean_ms:9.1f} {o.chat_engine_p99_ms:9.1f} "
            f"{o.chat_lost:4d}/{o.chat_sent:<4d} {o.flood_ok_per_s:8.2f} {o.flood_refused:5d} "
            f"{o.flood_refused_with_retry_after:5d} {o.flood_other_failures:6d}/{o.flood_sent}")


HEADER = (f"{'run':13} {'chat p50':>9} {'chat p99':>9} {'chat mean':>9} {'eng p99':>9} {'lost':>9} {'flood ok/s':>8} "
          f"{'refus':>5} {'w/RA':>5} {'other':>6}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--chat-rate", type=float, default=3.0)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--flood-rate", type=float, default=12.0)
    parser.add_argument("--doc-tokens", default="8000:24000", help="flood document length range, in tokens")
    parser.add_argument("--timeout", type=float, default=60.0, help="the clients' timeout per request (s)")
    parser.add_argument("--max-start-delay-ms", type=float, default=None,
                        help="admission.max_start_delay_ms for the admission runs (default: kvgate's)")
    parser.add_argument("--headroom", type=float, default=None,
                        help="admission.headroom for the admission runs (default: kvgate's)")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", type=Path, default=None, help="write every outcome as JSON here")
    args = parser.parse_args()
    runs = args.runs.split(",")
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        for repeat in range(args.repeats):
            order = runs[repeat % len(runs):] + runs[: repeat % len(runs)]
            print(f"repeat {repeat + 1}: {', '.join(order)}", flush=True)
            print(HEADER, flush=True)
            for run in order:
                outcome = await one_run(run, args, seed=1000 * repeat, tmp=Path(tmp))
                outcomes.append(outcome)
                print(row(outcome), flush=True)
    print("\nmedians over repeats")
    print(HEADER)
    for run in runs:
        mine = [o for o in outcomes if o.run == run]
        median = Outcome(run, *(statistics.median_low(getattr(o, f) for o in mine)
                                for f in list(Outcome.__dataclass_fields__)[1:]))  # type: ignore[arg-type]
        print(row(median))
    alone = {i: o for i, o in enumerate(o for o in outcomes if o.run == "alone")}
    for run in runs:
        if run == "alone":
            continue
        ratios = [o.chat_p99_ms / alone[i].chat_p99_ms for i, o in enumerate(x for x in outcomes if x.run == run)
                  if i in alone]
        if ratios:
            print(f"chat p99 {run} / alone, per repeat: {', '.join(f'{r:.2f}' for r in ratios)}")
    if args.out is not None:
        args.out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stopped by kill or timeout: stop what it started
    sys.exit(asyncio.run(main()))
