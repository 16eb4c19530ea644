"""The standing matrix's verdict: for each workload run by ``benchmarks/matrix.sh``, the cost policy's wins per
repeat against every other router on engine-clock and client TTFT, mean and p99, from each run's ``results.json``
(``wins_per_repeat``), and whether it won every repeat everywhere.

    .venv/bin/python benchmarks/matrix_report.py bench-out/matrix
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METRICS = ("engine_ttft_mean_ms", "engine_ttft_p99_ms", "ttft_mean_ms", "ttft_p99_ms")


def verdict(doc: dict) -> tuple[list[str], bool]:
    """One line per baseline (its wins on each metric as ``wins/compared``) and whether every repeat was a win."""
    lines, all_won = [], True
    by_baseline: dict[str, dict[str, dict]] = {}
    for w in doc.get("wins_per_repeat") or []:
        if w["metric"] in METRICS:
            by_baseline.setdefault(w["baseline"], {})[w["metric"]] = w
    for baseline, wins in by_baseline.items():
        cells = []
        for metric in METRICS:
            w = wins.get(metric)
            if w is None or not w["compared"]:
                cells.append(f"{metric} n/a")
                continue
            all_won &= w["wins"] == w["compared"]
            cells.append(f"{metric} {w['wins']}/{w['compared']}")
        lines.append(f"  vs {baseline}: " + ", ".join(cells))
    return lines, all_won and bool(by_baseline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="benchmarks/matrix.sh's OUT directory")
    args = parser.parse_args()
    runs = sorted(args.out.glob("*/results.json"))
    if not runs:
        print(f"no results under {args.out}", file=sys.stderr)
        return 1
    for path in runs:
        doc = json.loads(path.read_text())
        lines, all_won = verdict(doc)
        repeats = doc.get("meta", {}).get("repeats", 1)
        print(f"{path.parent.name} ({repeats} repeats): cost won every repeat: {'yes' if all_won else 'no'}")
        print("\n".join(lines) if lines else "  no paired wins (one repeat, or cost did not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
