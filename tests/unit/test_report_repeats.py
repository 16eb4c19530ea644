"""Several repeats reduced on fixed inputs: medians with min/max, paired wins (ties and missing values included),
the rotated run order, and the repeated results.json / report.md layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from kvgate.loadgen.bench import rotated
from kvgate.loadgen.report import (
    Repeat, RepeatedComparison, median_summaries, metric_ranges, paired_wins, print_table, summarize,
    write_repeated_results,
)
from tests.unit.test_report import record


def three_repeats() -> list[dict[str, dict[str, object]]]:
    return [
        {"cost": {"engine_ttft_mean_ms": 90.0, "engine_ttft_p99_ms": 300.0, "ttft_mean_ms": 100.0, "ok": 20,
                  "gateway": {"decisions": {"route/warm": 18.0}}},
         "prefix_affinity": {"engine_ttft_mean_ms": 100.0, "engine_ttft_p99_ms": 300.0, "ttft_mean_ms": 120.0,
                             "ok": 20}},
        {"cost": {"engine_ttft_mean_ms": 110.0, "engine_ttft_p99_ms": 280.0, "ttft_mean_ms": math.nan, "ok": 19,
                  "gateway": {"decisions": {"route/warm": 16.0, "route/cold": 3.0}}},
         "prefix_affinity": {"engine_ttft_mean_ms": 100.0, "engine_ttft_p99_ms": 320.0, "ttft_mean_ms": 110.0,
                             "ok": 20}},
        {"cost": {"engine_ttft_mean_ms": 80.0, "engine_ttft_p99_ms": 250.0, "ttft_mean_ms": 90.0, "ok": 20,
                  "gateway": {"decisions": {"route/warm": 20.0}}},
         "prefix_affinity": {"engine_ttft_mean_ms": 100.0, "engine_ttft_p99_ms": 310.0, "ttft_mean_ms": None,
                             "ok": 20}},
    ]


def test_medians_take_each_field_over_the_repeats_that_have_it() -> None:
    medians = median_summaries(three_repeats())
    assert list(medians) == ["cost", "prefix_affinity"]
    assert medians["cost"]["engine_ttft_mean_ms"] == 90.0
    assert medians["cost"]["engine_ttft_p99_ms"] == 280.0
    assert medians["cost"]["ttft_mean_ms"] == pytest.approx(95.0)  # NaN repeat left out: median of 100 and 90
    assert medians["cost"]["ok"] == 20
    assert medians["cost"]["gateway"] == {"decisions": {"route/warm": 18.0, "route/cold": 3.0}}
    assert medians["prefix_affinity"]["ttft_mean_ms"] == pytest.approx(115.0)
    only_missing = median_summaries([{"cost": {"ttft_p99_ms": None}}, {"cost": {"ttft_p99_ms": math.nan}}])
    assert math.isnan(only_missing["cost"]["ttft_p99_ms"])


def test_one_repeat_gives_back_its_own_summary() -> None:
    records = [record(0, "r0", 0.0, 0.1, 1.0), record(1, "r1", 0.5, 0.2, 2.0, status=500)]
    summary = {**summarize(records, ["r0", "r1"]), "router_cpu_s": None}
    medians = median_summaries([{"cost": summary}])["cost"]
    assert medians.keys() == summary.keys()
    for key, value in summary.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            assert math.isnan(medians[key]), key  # no data stays no data (null in results.json)
        else:
            assert medians[key] == value and type(medians[key]) is type(value), key


def test_ranges_are_min_and_max_of_present_values() -> None:
    ranges = metric_ranges(three_repeats())
    assert ranges["cost"]["engine_ttft_mean_ms"] == (80.0, 110.0)
    assert ranges["cost"]["ttft_mean_ms"] == (90.0, 100.0)
    assert ranges["prefix_affinity"]["engine_ttft_p99_ms"] == (300.0, 320.0)
    assert "ttft_p99_ms" not in ranges["cost"]  # no repeat has it: no range is invented


def test_paired_wins_count_strict_wins_ties_and_missing_values() -> None:
    wins = {w.metric.key: w for w in paired_wins(three_repeats())}
    assert {w.baseline for w in wins.values()} == {"prefix_affinity"}
    mean = wins["engine_ttft_mean_ms"]
    assert (mean.wins, mean.ties, mean.compared, mean.repeats) == (2, 0, 3, 3)
    assert mean.ratios == pytest.approx((0.9, 1.1, 0.8))
    assert mean.sentence() == "cost < prefix_affinity on engine TTFT mean (model clock) in 2/3 repeats (ratios 0.80–1.10)"
    p99 = wins["engine_ttft_p99_ms"]
    assert (p99.wins, p99.ties, p99.compared) == (2, 1, 3)  # 300 vs 300 is a tie, not a win
    assert "2/3 repeats" in p99.sentence() and "1 tied" in p99.sentence()
    wall = wins["ttft_mean_ms"]  # cost has NaN in repeat 2, the baseline None in repeat 3
    assert (wall.wins, wall.compared, wall.repeats) == (1, 1, 3)
    assert wall.sentence().endswith("in 1/1 repeats (ratios 0.83–0.83); 2 of 3 repeats lack a value")
    none = wins["ttft_p99_ms"]
    assert none.compared == 0 and none.sentence().endswith("no repeat where both have a value")
    assert paired_wins([{"round_robin": {"ttft_mean_ms": 1.0}}]) == []  # no candidate, nothing to claim


def test_every_run_takes_every_position_once_over_as_many_repeats() -> None:
    runs = ["cost", "prefix_affinity", "round_robin"]
    orders = [rotated(runs, k) for k in range(4)]
    assert orders[0] == runs
    assert orders[1] == ["prefix_affinity", "round_robin", "cost"]
    assert orders[3] == runs
    for position in range(3):
        assert {order[position] for order in orders[:3]} == set(runs)


def test_repeated_results_keep_every_repeat(tmp_path: Path) -> None:
    fast = [record(i, "r0", i * 0.1, 0.05, i * 0.1 + 0.2) for i in range(4)]
    slow = [record(i, "r1", i * 0.1, 0.10, i * 0.1 + 0.3) for i in range(4)]
    repeats = []
    for k, order in enumerate([["cost", "round_robin"], ["round_robin", "cost"]]):
        runs = {"cost": fast if k == 0 else slow, "round_robin": slow}
        summaries = {name: summarize(recs) for name, recs in runs.items()}
        repeats.append(Repeat(order=order, targets={n: f"http://127.0.0.1:{k}" for n in runs}, records=runs,
                              summaries=summaries))
    comparison = RepeatedComparison.of(repeats)
    write_repeated_results(tmp_path, {"workload": "unique", "repeats": 2}, comparison, "t")

    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["repeat"] for r in doc["repeats"]] == [1, 2]
    assert doc["repeats"][1]["order"] == ["round_robin", "cost"]
    assert len(doc["repeats"][1]["requests"]["cost"]) == 4
    assert doc["summaries"]["cost"]["ttft_mean_ms"] == pytest.approx(75.0)  # median of 50 and 100
    assert doc["ranges"]["cost"]["ttft_mean_ms"] == pytest.approx([50.0, 100.0])
    assert doc["ratios_to_best_baseline"]["ttft_mean_ms"]["ratio"] == pytest.approx(0.75)
    ttft = next(w for w in doc["wins_per_repeat"] if w["metric"] == "ttft_mean_ms")
    assert (ttft["wins"], ttft["ties"], ttft["compared"]) == (1, 1, 2)

    report = (tmp_path / "report.md").read_text()
    assert "| TTFT mean (ms) | 75.0 (50.0–100) | 100 (100–100) | 0.75× vs round_robin |" in report
    assert "## Wins per repeat" in report
    assert "- cost < round_robin on TTFT mean in 1/2 repeats (ratios 0.50–1.00), 1 tied" in report

    console = Console(record=True, width=200)
    print_table("t", comparison.summaries, comparison.ratios, console, comparison.ranges, comparison.wins)
    text = console.export_text()
    assert "75.0 (50.0–100)" in text and "wins per repeat" in text


def test_paired_results_within_one_percent_are_ties() -> None:
    repeats = [
        {"cost": {"engine_ttft_p99_ms": 184.9}, "round_robin": {"engine_ttft_p99_ms": 185.0}},  # both at a floor
        {"cost": {"engine_ttft_p99_ms": 180.0}, "round_robin": {"engine_ttft_p99_ms": 185.0}},
    ]
    (p99,) = paired_wins(repeats, metrics=("engine_ttft_p99_ms",))
    assert (p99.wins, p99.ties, p99.compared) == (1, 1, 2)
