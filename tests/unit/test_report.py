"""Report math on fixed inputs: percentiles, hit ratio, oracle ratio, imbalance, ratios to the best baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvgate.loadgen.report import (
    audit_lines, compare, inflight_timeline, load_imbalance, percentile, schedule_warning, summarize, tail_lines, write_results,
)
from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.workloads.oracle import IdealPrefill


def record(i: int, replica: str, start: float, ttft: float, end: float, prompt: int = 100, cached: int = 0,
           oracle: int = 0, status: int = 200, itl: list[float] | None = None, output: int = 10) -> RequestRecord:
    return RequestRecord(
        index=i, endpoint="completions", session_id=None, arrival_s=start, start_s=start,
        expected_prompt_tokens=prompt, oracle_hit_tokens=oracle, end_s=end, first_token_s=start + ttft,
        status=status, replica=replica, prompt_tokens=prompt if status == 200 else None,
        cached_tokens=cached if status == 200 else None, output_tokens=output if status == 200 else 0,
        itl_s=itl or [],
    )


def test_percentile_matches_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_summary_numbers() -> None:
    records = [
        record(0, "r0", 0.0, 0.1, 1.0, prompt=100, cached=0, oracle=0, itl=[0.01, 0.03]),
        record(1, "r1", 0.0, 0.3, 2.0, prompt=300, cached=200, oracle=240, itl=[0.02]),
        record(2, "r0", 1.0, 0.2, 2.0, prompt=100, cached=50, oracle=80),
        record(3, "r1", 1.0, 0.0, 1.5, prompt=100, oracle=80, status=503),
    ]
    s = summarize(records, replicas=["r0", "r1", "r2"])
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["ttft_mean_ms"] == pytest.approx(200.0)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["e2e_p50_ms"] == pytest.approx(1000.0)
    assert s["itl_mean_ms"] == pytest.approx(20.0)
    assert s["hit_ratio"] == pytest.approx(250 / 500)
    assert s["oracle_hit_ratio"] == pytest.approx(400 / 600)  # over every request sent, failed ones too
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["throughput_rps"] == pytest.approx(1.5)
    assert s["output_tok_s"] == pytest.approx(15.0)
    assert s["requests_per_replica"] == {"r0": 2, "r1": 1, "r2": 0}
    assert s["send_lag_mean_ms"] == 0.0 and schedule_warning(s) is None


def test_inter_token_latency_client_and_engine_clock_mean_and_p99() -> None:
    smooth = record(0, "r0", 0.0, 0.1, 1.0, itl=[0.010] * 99)
    smooth.engine_itl_ms = [6.0] * 99
    stalled = record(1, "r1", 0.0, 0.1, 1.0, itl=[0.010] * 98 + [0.300])
    stalled.engine_itl_ms = [6.0] * 97 + [290.0, 290.0]
    failed = record(2, "r1", 0.0, 0.1, 1.0, itl=[5.0], status=503)
    failed.engine_itl_ms = [900.0]
    s = summarize([smooth, stalled, failed])
    client = [10.0] * 197 + [300.0]
    engine = [6.0] * 196 + [290.0, 290.0]
    assert s["itl_mean_ms"] == pytest.approx(sum(client) / len(client))
    assert s["itl_p99_ms"] == pytest.approx(percentile(client, 99))
    assert s["engine_itl_mean_ms"] == pytest.approx(sum(engine) / len(engine))
    assert s["engine_itl_p99_ms"] == pytest.approx(percentile(engine, 99)) and s["engine_itl_p99_ms"] > 6.0
    assert s["engine_itl_p999_ms"] == pytest.approx(percentile(engine, 99.9))
    assert s["output_tok_s"] == pytest.approx(20.0)  # failed requests' tokens do not count
    assert math.isnan(summarize([record(3, "r0", 0.0, 0.1, 1.0)])["engine_itl_p99_ms"])


def test_oracle_ttft_prices_only_what_an_infinite_shared_cache_lacks() -> None:
    ideal = IdealPrefill(step_overhead_ms=6.0, prefill_ms_per_token=0.035, request_overhead_ms=20.0, token_budget=8192)
    assert ideal.ttft_ms(10_000, 0) == pytest.approx(2 * 6.0 + 0.035 * 10_000 + 20.0)  # two chunks of prefill
    assert ideal.ttft_ms(10_000, 9_984) == pytest.approx(6.0 + 0.035 * 16 + 20.0)
    assert ideal.ttft_ms(32, 32) == pytest.approx(6.0 + 0.035 * 16 + 20.0)  # the last token is always computed
    records = [
        record(0, "r0", 0.0, 0.5, 1.0, prompt=10_000, oracle=0),
        record(1, "r0", 0.0, 0.1, 1.0, prompt=10_000, oracle=9_984),
    ]
    records[0].engine_ttft_ms, records[1].engine_ttft_ms = 400.0, 100.0
    s = summarize(records, ideal=ideal)
    floor = (ideal.ttft_ms(10_000, 0) + ideal.ttft_ms(10_000, 9_984)) / 2
    assert s["oracle_ttft_mean_ms"] == pytest.approx(floor)
    assert s["engine_ttft_vs_oracle"] == pytest.approx(250.0 / floor)
    assert s["ttft_vs_oracle"] == pytest.approx(300.0 / floor)


def test_late_sends_are_flagged() -> None:
    late = record(0, "r0", 1.0, 0.1, 2.0)
    late.arrival_s = 0.5
    s = summarize([late])
    assert s["send_lag_mean_ms"] == pytest.approx(500.0)
    assert "500 ms late" in (schedule_warning(s) or "")


def test_inflight_timeline_and_imbalance() -> None:
    # r0 carries two requests all the time, r1 one during the first half: imbalance is max/mean per instant.
    spans = [("r0", 0.0, 10.0), ("r0", 0.0, 10.0), ("r1", 0.0, 5.0)]
    times, series = inflight_timeline(spans, ["r0", "r1"], samples=10)
    assert len(times) == 10
    assert series["r0"] == [2] * 10
    assert series["r1"] == [1] * 5 + [0] * 5
    # first half: max 2 / mean 1.5; second half: 2 / 1.
    assert load_imbalance(series) == pytest.approx((5 * (2 / 1.5) + 5 * 2.0) / 10)


def test_imbalance_counts_idle_replicas() -> None:
    _, series = inflight_timeline([("r0", 0.0, 1.0)], ["r0", "r1", "r2", "r3"], samples=4)
    assert load_imbalance(series) == pytest.approx(4.0)  # everything on one of four replicas
    _, even = inflight_timeline([(f"r{i}", 0.0, 1.0) for i in range(4)], [f"r{i}" for i in range(4)], samples=4)
    assert load_imbalance(even) == pytest.approx(1.0)
    assert inflight_timeline([], ["r0"]) == ([], {"r0": []})  # e.g. a peer router that names no replica


def test_ratios_to_best_baseline() -> None:
    summaries = {
        "cost": {"ttft_mean_ms": 80.0, "throughput_rps": 9.0, "hit_ratio": 0.5, "errors": 0, "ttft_p99_ms": math.nan},
        "round_robin": {"ttft_mean_ms": 200.0, "throughput_rps": 10.0, "hit_ratio": 0.1, "errors": 0, "ttft_p99_ms": 5.0},
        "least_loaded": {"ttft_mean_ms": 100.0, "throughput_rps": 8.0, "hit_ratio": 0.2, "errors": 2, "ttft_p99_ms": 4.0},
    }
    ratios = compare(summaries)
    assert ratios["ttft_mean_ms"]["best_baseline"] == "least_loaded"
    assert ratios["ttft_mean_ms"]["ratio"] == pytest.approx(0.8) and ratios["ttft_mean_ms"]["better"]
    assert ratios["throughput_rps"]["best_baseline"] == "round_robin"
    assert ratios["throughput_rps"]["ratio"] == pytest.approx(0.9) and not ratios["throughput_rps"]["better"]
    assert ratios["hit_ratio"]["ratio"] == pytest.approx(2.5)
    assert ratios["errors"]["best_baseline"] == "round_robin"
    assert "ttft_p99_ms" not in ratios  # the candidate has no value: no ratio is invented
    assert compare({"round_robin": summaries["round_robin"]}) == {}


def test_results_are_strict_json(tmp_path: Path) -> None:
    records = [record(0, "r0", 0.0, 0.1, 1.0, status=500)]
    summaries = {"cost": summarize(records), "round_robin": summarize(records)}
    write_results(tmp_path, {"workload": "unique"}, {"cost": records, "round_robin": records}, summaries,
                  compare(summaries), "t")
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["summaries"]["cost"]["ttft_mean_ms"] is None
    assert doc["requests"]["cost"][0]["status"] == 500
    assert "| TTFT mean (ms) | n/a | n/a |" in (tmp_path / "report.md").read_text()


def test_the_prediction_audit_splits_the_error_into_its_terms() -> None:
    records = [record(i, "a", 0.0, 0.1, 0.2) for i in range(5)]
    # (predicted ttft, queue, load) against (engine ttft, queue, load): the prefill under-predicted by 10 ms in every
    # request the engine reported (not the fourth); in the first three the queue over-predicted by 40 ms and the load
    # under-predicted by 5; the fifth loads nothing on either side, so it is no part of the load term's error.
    pairs = [(100, 50, 0, 75, 10, 5), (200, 60, 10, 175, 20, 15), (90, 40, 0, 65, 0, 5), (80, 0, 0, None, None, None),
             (115, 50, 0, 75, 0, 0)]
    for r, (pt, pq, pl, et, eq, el) in zip(records, pairs):
        r.predicted_ttft_ms, r.predicted_queue_ms, r.predicted_load_ms = pt, pq, pl
        r.engine_ttft_ms, r.engine_queue_ms, r.engine_load_ms = et, eq, el
    # the interference term: 30 ms predicted for each, against 0, 20 and 100 ms imposed
    for r, (predicted, imposed) in zip(records, [(30, 0), (30, 20), (30, 100), (30, None), (None, None)]):
        r.predicted_interference_ms, r.engine_interference_ms = predicted, imposed
    audit = summarize(records)
    assert audit["audit_compared"] == 4 and audit["audit_load_compared"] == 3
    assert audit["audit_ttft_bias_ms"] == pytest.approx(25) and audit["audit_ttft_mae_ms"] == pytest.approx(28.75)
    assert audit["audit_queue_bias_ms"] == pytest.approx(40) and audit["audit_queue_mae_ms"] == pytest.approx(42.5)
    assert audit["audit_load_bias_ms"] == pytest.approx(-5) and audit["audit_load_mae_ms"] == pytest.approx(5)
    assert audit["audit_load_total_ratio"] == pytest.approx(10 / 25)
    assert audit["audit_prefill_bias_ms"] == pytest.approx(-10) and audit["audit_prefill_mae_ms"] == pytest.approx(10)
    assert audit["audit_interference_bias_ms"] == pytest.approx(10)
    assert audit["audit_interference_mae_ms"] == pytest.approx((30 + 10 + 70) / 3)
    assert audit["audit_interference_total_ratio"] == pytest.approx(90 / 120)
    line = audit_lines({"cost": audit})[-1]
    assert "load bias -5.0 ms, |error| 5.0 over 3 requests with a load, in total 0.40× the engines'" in line
    assert "interference predicted in total 0.75×" in line
    for r in records:
        r.predicted_load_ms = r.engine_load_ms = 0.0 if r.engine_load_ms is not None else None
    unloaded = summarize(records)
    assert unloaded["audit_load_compared"] == 0 and math.isnan(unloaded["audit_load_bias_ms"])
    assert "no loads from a cached tier" in audit_lines({"cost": unloaded})[-1]
    blind = summarize([record(0, "a", 0.0, 0.1, 0.2)])  # a router that predicts nothing
    assert blind["audit_compared"] == 0 and math.isnan(blind["audit_ttft_bias_ms"])
    assert audit_lines({"round_robin": blind}) == []


def test_the_tail_audit_describes_the_slowest_percent_against_every_request() -> None:
    # 200 requests of 1,000 tokens answered in 100 ms, then two of 9,000 tokens that waited 3 s and 5 s, of which the
    # engine's clock saw 1,500 and 2,500 ms (500 and 1,500 ms in its queue). The slowest 1%, rounded up, are those two
    # and one of the rest.
    records = [record(i, "a", 0.0, 0.1, 0.2, prompt=1000) for i in range(200)]
    records += [record(200, "b", 0.0, 3.0, 3.1, prompt=9000), record(201, "b", 0.0, 5.0, 5.1, prompt=9000)]
    for r, (engine, queue) in zip(records[-2:], ((1500, 500), (2500, 1500))):
        r.engine_ttft_ms, r.engine_queue_ms = engine, queue
    tail = summarize(records)
    assert tail["tail_requests"] == 3  # ceil(1% of 202)
    assert tail["tail_ttft_mean_ms"] == pytest.approx((3000 + 5000 + 100) / 3)
    assert tail["tail_prompt_tokens_mean"] == pytest.approx((9000 + 9000 + 1000) / 3)
    assert tail["prompt_tokens_mean"] == pytest.approx((200 * 1000 + 2 * 9000) / 202)
    assert tail["tail_engine_ttft_mean_ms"] == pytest.approx(2000)  # the two the engine clock saw
    assert tail["tail_engine_queue_mean_ms"] == pytest.approx(1000)
    lines = tail_lines({"cost": tail})
    assert "- cost: the slowest 3 averaged 2,700 ms, prompts of 6,333 tokens (every request: 1,079); 2,000 ms of it " \
           "in an engine (model clock), 1,000 ms of that in its queue" in lines
    assert math.isnan(tail["tail_before_dispatch_mean_ms"])  # behind a router that logs nothing
    assert "tail_requests" not in summarize([record(0, "a", 0.0, 0.1, 0.2, status=500)])


def test_the_tail_audit_splits_kvgate_s_own_time_from_the_engine_s() -> None:
    # kvgate logged every request's TTFT from its arrival and the part after dispatch: the short ones 90 ms of which
    # 80 after dispatch; the two slow ones 2,900 and 4,900 ms, held 1,000 and 3,000 ms before dispatch.
    records = [record(i, "a", 0.0, 0.1, 0.2, prompt=1000) for i in range(200)]
    records += [record(200, "b", 0.0, 3.0, 3.1, prompt=9000), record(201, "b", 0.0, 5.0, 5.1, prompt=9000)]
    for r in records[:200]:
        r.gateway_ttft_ms, r.upstream_ttft_ms = 90.0, 80.0
    records[200].gateway_ttft_ms, records[200].upstream_ttft_ms = 2900.0, 1900.0
    records[201].gateway_ttft_ms, records[201].upstream_ttft_ms = 4900.0, 1900.0
    tail = summarize(records)
    assert tail["tail_before_dispatch_mean_ms"] == pytest.approx((1000 + 3000 + 10) / 3)
    assert tail["tail_upstream_ttft_mean_ms"] == pytest.approx((1900 + 1900 + 80) / 3)
    assert tail["before_dispatch_mean_ms"] == pytest.approx((200 * 10 + 1000 + 3000) / 202)
    assert tail["upstream_ttft_mean_ms"] == pytest.approx((200 * 80 + 2 * 1900) / 202)
    line = next(line for line in tail_lines({"cost": tail}) if line.startswith("- cost"))
    assert line.endswith("; in kvgate 1,337 ms before dispatch (every request: 30), then 1,293 ms to the engine's "
                         "first token (every request: 98)")
