"""The table of ``benchmarks/gateways.sh``: 1 gateway vs N without and with peer hints, per run and as medians.

Starved runs are left out (and named): with failed requests (the sim so starved that health checks failed, which
resets the index) or a load generator more than ``MAX_SEND_LAG_MS`` late on average. Of the rest, it separates what the engines saw from what this machine's CPU did to the
requests:

- engine TTFT is the sim's own clock (queueing and prefill the routing caused);
- client TTFT is the wall clock at the load generator, divided by the sim's time scale so it is in the same model
  ms; client minus engine is what CPU contention (gateways, sim and load generator sharing the cores) added;
- where the siblings of one document landed, as the engines report it: a sibling miss is a request whose document
  some replica already held (the workload's oracle) but which the serving replica computed for the most part (less
  than half of it cached); "early" ones came within ``EARLY_S`` of the document's previous request, before the
  engines' events could confirm where that one went — the ones a gateway's own predictions (or its peers' hints)
  are there to prevent. Copies count the (document, replica) pairs beyond one per document.

    benchmarks/gateways_report.py OUT [MODE...] [--closed-loop]   (default 1 3 3h: runs OUT/g<MODE>-r<k>/)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from kvgate.loadgen.bench import add_arguments
from kvgate.loadgen.cli import load_workload

MAX_SEND_LAG_MS = 50.0
"""A load generator this late on average sent its arrivals in bursts: the run measured the machine, not routing."""
EARLY_S = 2.0
"""A sibling this soon after its document's previous request: the first one's events may not be in yet."""


def document_of(argv: str) -> list[str]:
    """Each request's document (its prompt's first 400 characters), from the run's own workload arguments."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv.split()[1:])
    requests = load_workload(args, Console(stderr=True))
    assert requests is not None
    return [str(r.body.get("prompt") or r.body.get("messages"))[:400] for r in requests]


def run_metrics(path: Path) -> dict[str, float]:
    doc = json.loads(path.read_text())
    summary, records, meta = doc["summaries"]["cost"], doc["requests"]["cost"], doc["meta"]
    scale = meta["time_scale"]
    documents = document_of(meta["argv"])
    ok = [r for r in records if r["status"] == 200 and r.get("first_token_s") is not None]
    client = [(r["first_token_s"] - r["start_s"]) * 1000.0 / scale for r in ok]
    engine = [r["engine_ttft_ms"] for r in ok if r.get("engine_ttft_ms") is not None]
    served: dict[str, set[str]] = {}
    last_start: dict[str, float] = {}
    misses = early = 0
    for r in sorted(ok, key=lambda r: r["start_s"]):
        document = documents[r["index"]]
        if r["oracle_hit_tokens"] > 0 and (r["cached_tokens"] or 0) < r["oracle_hit_tokens"] / 2:
            misses += 1
            early += r["start_s"] - last_start.get(document, -EARLY_S) < EARLY_S
        served.setdefault(document, set()).add(r["replica"])
        last_start[document] = r["start_s"]
    decisions = (summary.get("gateway") or {}).get("decisions", {})
    return {
        "engine_mean": statistics.fmean(engine), "engine_p99": _p99(engine),
        "client_mean": statistics.fmean(client), "client_p99": _p99(client),
        "contention": statistics.fmean(client) - statistics.fmean(engine),
        "hit_ratio": summary["hit_ratio"], "prefilled": summary["prefill_tokens_computed"],
        "misses": misses, "early_misses": early, "copies": sum(map(len, served.values())) - len(served),
        "cold": decisions.get("route/cold", float("nan")), "errors": summary["errors"],
        "send_lag": summary.get("send_lag_mean_ms", float("nan")),
        "router_cpu": summary["router_cpu_s"] or float("nan"), "sim_cpu": summary["sim_cpu_s"] or float("nan"),
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("engine_mean", "engine TTFT mean (ms)", "{:.0f}".format),
    ("engine_p99", "engine TTFT p99 (ms)", "{:.0f}".format),
    ("client_mean", "client TTFT mean (model ms)", "{:.0f}".format),
    ("client_p99", "client TTFT p99 (model ms)", "{:.0f}".format),
    ("contention", "client − engine, mean (ms)", "{:.0f}".format),
    ("hit_ratio", "hit ratio (engines)", "{:.3f}".format),
    ("prefilled", "prompt tokens prefilled", lambda v: f"{v / 1000:.0f}k"),
    ("misses", "sibling misses", "{:.0f}".format),
    ("early_misses", f"of them within {EARLY_S:.0f} s of the previous", "{:.0f}".format),
    ("copies", "copies (document on one more replica)", "{:.0f}".format),
    ("cold", "cold placements (gateways' route/cold)", "{:.0f}".format),
    ("send_lag", "load generator's send lag, mean (ms)", "{:.0f}".format),
    ("router_cpu", "gateways' CPU (s)", "{:.1f}".format),
    ("sim_cpu", "sim CPU (s)", "{:.1f}".format),
]


def label(mode: str) -> str:
    """``1`` → 1 gateway, ``3`` → 3 gateways, ``3h`` → with hints, ``3n`` → hints with work sharing off, ``3i`` →
    3 gateways of which only the first takes requests."""
    n = mode.rstrip("hni")
    gateways = "1 gateway" if n == "1" else f"{n} gateways"
    suffixes = {"": "", "h": " + hints", "n": " + hints, no work sharing", "i": ", requests to 1 (others idle)"}
    return gateways + suffixes[mode[len(n):]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("modes", nargs="*", default=["1", "3", "3h"])
    parser.add_argument("--closed-loop", action="store_true",
                        help="the workload's concurrency cap holds requests back by design: a late load generator "
                             "is not a starved run")
    args = parser.parse_args()
    out, modes = args.out, args.modes
    max_send_lag_ms = float("inf") if args.closed_loop else MAX_SEND_LAG_MS
    runs: dict[str, list[dict[str, float]]] = {}
    for mode in modes:
        runs[mode] = []
        for path in sorted(out.glob(f"g{mode}-r*/results.json")):
            metrics = run_metrics(path)
            if metrics["errors"] or not metrics["send_lag"] <= max_send_lag_ms:
                print(f"left out {path.parent.name} (starved): {metrics['errors']:.0f} failed requests, the load "
                      f"generator {metrics['send_lag']:.0f} ms late on average")
            else:
                runs[mode].append(metrics)
    present = [mode for mode in modes if runs[mode]]
    if not present:
        print("no run to report")
        return 1
    print("| metric | " + " | ".join(label(m) for m in present) + "".join(f" | {m} / 1" for m in present[1:]) + " |")
    print("|---" * (len(present) * 2) + "|")
    for key, name, fmt in ROWS:
        medians = {m: statistics.median(r[key] for r in runs[m]) for m in present}
        cells = [f"{fmt(medians[m])} ({', '.join(fmt(r[key]) for r in runs[m])})" for m in present]
        base = medians[present[0]]
        ratios = [f"{medians[m] / base:.2f}" if base else "" for m in present[1:]]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
