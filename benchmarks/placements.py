"""Where each router put the prefixes it had already placed: copies, evictions, cold placements, per run.

A router loses hits two ways: it sends a request away from a replica that holds its prefix and recomputes it
elsewhere (a *copy*: one more replica now holds that prefix, and its later traffic splits between them), or the
holder evicted the prefix (an *eviction miss*). The engines' eviction counters cannot tell the two apart from a
lower hit ratio; this script can. It rebuilds the bench's seeded workload from the run's own argv (results.json
``meta.argv``), replays every run's requests in the order they started, and keeps, per replica, every block chain
it was sent (as if it never evicted). For each request:

* ``best`` — the longest prefix any replica had been sent before it; ``here`` — on the replica the router chose;
* *copy* when ``best − here`` is at least ``--min-tokens``: those tokens were recomputed although a replica held
  them (unless it had evicted them);
* *warmed* when the engine reports the prefix cached anyway (a hot-prefix warm-up put it there);
* *eviction miss* when the engine's reported cached tokens fall short of ``here`` by that much: the chosen replica
  had been sent the prefix, and no longer held it;
* *cold* when ``best`` is below ``--min-tokens``.

    .venv/bin/python benchmarks/placements.py bench-out/capacity/docs-tight-30 [--min-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvgate.loadgen.bench import add_arguments
from kvgate.loadgen.cli import workload_options
from kvgate.loadgen.workloads import build_workload
from kvgate.loadgen.workloads.oracle import ORACLE_BLOCK_SIZE
from kvgate.loadgen.workloads.request import Request
from kvgate.loadgen.workloads.vocabulary import vocabulary_for

PASS_THROUGH = {"--peer-args", "--sim-args", "--serve-args", "--engine-args"}


def chain_keys(ids: list[int], block_size: int = ORACLE_BLOCK_SIZE) -> list[int]:
    """One key per full block, identifying the block and everything before it."""
    keys, parent = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start : start + block_size])))
        keys.append(parent)
    return keys


def prompt_keys(requests: list[Request], tokenizer_dir: Path) -> list[list[int]]:
    tokenizer = vocabulary_for(tokenizer_dir).tokenizer
    out = []
    for r in requests:
        if r.endpoint == "chat":
            ids = tokenizer.encode_chat(r.body["messages"])
        else:
            ids = tokenizer.encode(r.body["prompt"])
        out.append(chain_keys(list(ids)))
    return out


def matched(held: set[int], keys: list[int]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n * ORACLE_BLOCK_SIZE


def placements(records: list[dict[str, Any]], keys: list[list[int]], min_tokens: int) -> dict[str, float]:
    held: dict[str, set[int]] = defaultdict(set)
    counts: dict[str, float] = defaultdict(float)
    for rec in sorted((r for r in records if r["replica"]), key=lambda r: r["start_s"]):
        k = keys[rec["index"]]
        best = max((matched(h, k) for h in held.values()), default=0)
        here = matched(held[rec["replica"]], k)
        cached = rec["cached_tokens"] or 0
        if best < min_tokens:
            counts["cold"] += 1
        elif best - here >= min_tokens and best - cached >= min_tokens:
            counts["copies"] += 1
            counts["copy_tokens"] += best - max(here, cached)
        elif best - here >= min_tokens:
            counts["warmed"] += 1  # a hit on a replica that a warm-up (not a request) gave the prefix
        elif here - cached >= min_tokens:
            counts["eviction_misses"] += 1
            counts["eviction_tokens"] += here - cached
        else:
            counts["warm"] += 1
        held[rec["replica"]].update(k)
    return dict(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a kvgate bench --out directory")
    parser.add_argument("--min-tokens", type=int, default=512, help="smallest prefix difference counted (512)")
    args = parser.parse_args()
    doc = json.loads((args.out / "results.json").read_text())
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    argv = [a for a in shlex.split(doc["meta"]["argv"])[1:] if a not in PASS_THROUGH]
    bench_args, _ = bench.parse_known_args(argv)  # the pass-through options' values were not quoted in argv
    requests = build_workload(bench_args.workload, workload_options(bench_args))
    keys = prompt_keys(requests, bench_args.tokenizer)
    repeats = doc.get("repeats") or [{"repeat": 1, "requests": doc["requests"]}]
    fields = ("cold", "warm", "warmed", "copies", "copy_tokens", "eviction_misses", "eviction_tokens")
    print("repeat run " + " ".join(fields))
    for rep in repeats:
        for name, records in rep["requests"].items():
            c = placements(records, keys, args.min_tokens)
            print(f"{rep['repeat']} {name} " + " ".join(str(int(c.get(f, 0))) for f in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
