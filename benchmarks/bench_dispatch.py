"""kvgate's time before dispatch for long documents new to the gateway: what tokenizing them adds to their TTFT.

Two ``kvgate sim`` replicas at time scale 1 and kvgate in front of them, as subprocesses. Chats whose user turn is a
fresh document of random words (nothing of it cached in the tokenizer or on any replica) are sent one at a time,
streamed; kvgate's request log gives each one's time before dispatch (``ttft_ms − upstream_ttft_ms``: reading,
parsing, tokenizing, queueing, routing). A long prompt new to the gateway is routed on its beginning while the rest
is tokenized (docs/benchmarks.md, "Tokenization"), so this stays near a short prompt's whatever the document's length;
``kvgate_routed_on_prompt_beginning_total`` says how many were.

Run: ``.venv/bin/python benchmarks/bench_dispatch.py [--chars 60000 150000] [--requests 20]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate.loadgen.bench import KVGATE, free_port_block
from kvgate.loadgen.procs import ChildProcess
from kvgate.loadgen.runstats import scrape_gateway_counters

WARMUP = 2
"""Requests sent first and not counted (connections, the first request's one-off costs)."""
WORDS = ("alpha beta gamma delta kernel router cache prefix replica token block engine request latency model prompt "
         "document section table query").split()


def document(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of words with numbers: little of it repeats, so no piece of it is cached."""
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(chars // 10))


def measure(url: str, log: Path, chars: int, requests: int, rng: random.Random) -> list[float]:
    """Send ``requests`` fresh documents of ``chars`` characters; each one's ms before dispatch, from the log."""
    ids = []
    with httpx.Client(timeout=120.0) as client:
        for i in range(WARMUP + requests):
            request_id = f"dispatch-{chars}-{i}"
            body = {"model": "kvgate-sim", "max_tokens": 2, "stream": True, "messages": [
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": document(rng, chars)},
            ]}
            with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"x-request-id": request_id}) as response:
                response.raise_for_status()
                for _ in response.iter_bytes():
                    pass
            if i >= WARMUP:
                ids.append(request_id)
    found = log_lines(log, set(ids))
    return [found[i]["ttft_ms"] - found[i]["upstream_ttft_ms"] for i in ids]


def log_lines(log: Path, ids: set[str], timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """The request log lines of ``ids``, waiting for the last ones (a line is written once its answer is accounted,
    and the log is flushed by line)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if '"msg":"request"' in line]
        found = {line["id"]: line for line in lines if line.get("id") in ids}
        if len(found) == len(ids):
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"no request log line for {sorted(ids - found.keys())[:3]}")
        time.sleep(0.05)


def routed_on_beginning(url: str) -> float:
    counters = scrape_gateway_counters(url)
    if counters is None:
        raise SystemExit(f"kvgate at {url} did not answer /metrics")
    return counters["routed_on_prompt_beginning"].get("total", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, nargs="+", default=[2000, 60000, 150000],
                        help="document sizes in characters (default 2000 60000 150000)")
    parser.add_argument("--requests", type=int, default=20, help="documents per size (default 20)")
    args = parser.parse_args()
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        fleet = tmp_path / "fleet.yaml"
        sim_port, zmq_port, port = free_port_block(2), free_port_block(4), free_port_block(1)
        sim = ChildProcess("sim", [*KVGATE, "sim", "--replicas", "2", "--port", str(sim_port), "--zmq-port",
                                   str(zmq_port), "--time-scale", "1", "--max-model-len", "200000", "--kv-blocks",
                                   "32768", "--write-config", str(fleet)], tmp_path / "sim.log").start()
        try:
            sim.wait_http(f"http://127.0.0.1:{sim_port}/health", 60)
            log = tmp_path / "kvgate.log"
            kvgate = ChildProcess("kvgate", [*KVGATE, "serve", "--config", str(fleet), "--port", str(port)],
                                  log).start()
            try:
                url = f"http://127.0.0.1:{port}"
                kvgate.wait_http(f"{url}/health", 60)
                for chars in args.chars:
                    before = routed_on_beginning(url)
                    ms = measure(url, log, chars, args.requests, rng)
                    routed = routed_on_beginning(url) - before
                    print(f"{chars:>7,} chars: before dispatch mean {statistics.mean(ms):6.1f} ms, "
                          f"p50 {statistics.median(ms):6.1f}, max {max(ms):6.1f} "
                          f"({len(ms)} requests; {routed:.0f} of {WARMUP + len(ms)} routed on their beginning)")
            finally:
                kvgate.stop()
        finally:
            sim.stop()


if __name__ == "__main__":
    main()
