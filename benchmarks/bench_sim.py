"""How many short requests per second one ``kvgate sim`` process sustains at --time-scale 0 (8 replicas).

Starts the sim as a child process, drives it from this process (aiohttp, N concurrent workers spread over the
replicas' ports), and prints sustained requests/s over the measuring window. Run by hand:

    .venv/bin/python benchmarks/bench_sim.py [--replicas 8] [--concurrency 64] [--seconds 10] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp

from kvgate.loadgen.bench import KVGATE, free_port_block
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm


async def drive(urls: list[str], concurrency: int, warmup_s: float, seconds: float, max_tokens: int) -> None:
    counts = {"ok": 0, "failed": 0}
    measuring = asyncio.Event()
    stop_at = time.monotonic() + warmup_s + seconds
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while time.monotonic() < stop_at:
            url = urls[(w + i) % len(urls)]
            body = {"model": "kvgate-sim", "prompt": f"user {w} asks question number {i} about the sim",
                    "max_tokens": max_tokens}
            i += 1
            try:
                async with session.post(url, json=body) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if measuring.is_set():
                counts["ok" if ok else "failed"] += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(w, session)) for w in range(concurrency)]
        await asyncio.sleep(warmup_s)
        measuring.set()
        t0 = time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    print(f"replicas={len(urls)} concurrency={concurrency} max_tokens={max_tokens} window={elapsed:.1f}s")
    print(f"completed={counts['ok']} failed={counts['failed']} sustained={counts['ok'] / elapsed:,.0f} requests/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    http_port, zmq_port = free_port_block(args.replicas), free_port_block(2 * args.replicas)
    sim = ChildProcess(
        "kvgate sim", [*KVGATE, "sim", "--replicas", str(args.replicas), "--port", str(http_port), "--zmq-port", str(zmq_port),
         "--time-scale", "0"],
        Path("/tmp") / f"bench-sim-{http_port}.log",
    ).start()
    try:
        urls = [f"http://127.0.0.1:{http_port + i}/v1/completions" for i in range(args.replicas)]
        for i in range(args.replicas):
            sim.wait_http(f"http://127.0.0.1:{http_port + i}/health", 30)
        asyncio.run(drive(urls, args.concurrency, args.warmup, args.seconds, args.max_tokens))
    finally:
        sim.stop()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stopped by kill or timeout: stop what it started
    sys.exit(main())
