"""Plots are written for every run, including one whose responses name no replica (a peer router)."""

from __future__ import annotations

from pathlib import Path

from kvgate.loadgen.plots import write_plots
from kvgate.loadgen.report import summarize
from tests.unit.test_report import record


def test_plots_for_kvgate_and_a_peer(tmp_path: Path) -> None:
    kvgate = [record(i, f"r{i % 2}", i * 0.1, 0.05, i * 0.1 + 0.3, cached=i) for i in range(10)]
    peer = [record(i, "", i * 0.1, 0.05, i * 0.1 + 0.3) for i in range(10)]
    for r in peer:
        r.replica = None
    runs = {"cost": kvgate, "sglang": peer}
    summaries = {name: summarize(recs) for name, recs in runs.items()}
    paths = write_plots(tmp_path, runs, summaries, {"cost": ["r0", "r1"], "sglang": []})
    assert sorted(p.name for p in paths) == ["hit_ratio.png", "inflight_per_replica.png", "ttft_cdf.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
