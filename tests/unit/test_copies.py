"""The copies audit on a hand-made run: which placements recomputed a held prefix, and who reused what they brought."""

from __future__ import annotations

import pytest

from kvgate.loadgen.copies import copies_audit, copies_lines
from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.workloads.oracle import IdealPrefill, PrefixOracle
from kvgate.loadgen.workloads.request import Request

IDEAL = IdealPrefill()
DOC = list(range(1000, 1000 + 64 * 16))
"""A 1,024-token document: 64 blocks."""


def workload(prompts: list[list[int]]) -> list[Request]:
    oracle = PrefixOracle()
    out = []
    for i, ids in enumerate(prompts):
        hit, chain = oracle.observe(ids)
        out.append(Request(i, 0.0, "completions", {"prompt": ""}, 1, len(ids), hit, chain=chain))
    return out


def served(i: int, replica: str | None, start: float, prompt: int, cached: int, status: int = 200) -> RequestRecord:
    return RequestRecord(index=i, endpoint="completions", session_id=None, arrival_s=start, start_s=start,
                         expected_prompt_tokens=prompt, oracle_hit_tokens=0, end_s=start + 1, status=status,
                         replica=replica, prompt_tokens=prompt, cached_tokens=cached)


def test_a_copy_costs_its_recompute_and_is_credited_with_later_reuse() -> None:
    question = [[7] * 32, [8] * 32, [9] * 32]
    requests = workload([DOC + question[0], DOC + question[1], DOC + question[2]])
    n = len(DOC) + 32
    records = [
        served(0, "r0", 0.0, n, 0),        # first holder
        served(1, "r1", 1.0, n, 0),        # recomputes the 1,024 tokens r0 holds: a copy
        served(2, "r1", 2.0, n, len(DOC)),  # reuses what the copy brought
    ]
    audit = copies_audit(records, requests)
    assert audit["copies"] == 1
    assert audit["copy_tokens"] == len(DOC)
    assert audit["copy_cost_ms"] == pytest.approx(IDEAL.ttft_ms(n, 0) - IDEAL.ttft_ms(n, len(DOC)))
    assert audit["copy_saved_tokens"] == len(DOC)
    assert audit["copy_saved_ms"] == pytest.approx(audit["copy_cost_ms"])
    assert audit["warmup_saved_tokens"] == 0


def test_reuse_on_the_first_holder_credits_no_copy() -> None:
    requests = workload([DOC + [7] * 32, DOC + [8] * 32])
    audit = copies_audit([served(0, "r0", 0.0, 1056, 0), served(1, "r0", 1.0, 1056, len(DOC))], requests)
    assert audit["copies"] == 0 and audit["copy_saved_tokens"] == 0 and audit["warmup_saved_tokens"] == 0


def test_blocks_reused_where_no_request_sent_them_are_a_warm_ups() -> None:
    requests = workload([DOC + [7] * 32, DOC + [8] * 32, DOC + [9] * 32])
    records = [served(0, "r0", 0.0, 1056, 0),
               served(1, "r1", 1.0, 1056, len(DOC)),   # r1 never saw the document: a warm-up put it there
               served(2, "r1", 2.0, 1056, len(DOC))]   # and again: still the warm-up's blocks
    audit = copies_audit(records, requests)
    assert audit["copies"] == 0
    assert audit["warmup_saved_tokens"] == 2 * len(DOC)
    assert audit["copy_saved_tokens"] == 0


def test_a_small_recompute_of_a_held_prefix_is_not_a_copy() -> None:
    shared = DOC[:256]  # 16 blocks: below the 512-token floor
    requests = workload([shared + [7] * 32, shared + [8] * 32])
    audit = copies_audit([served(0, "r0", 0.0, 288, 0), served(1, "r1", 1.0, 288, 0)], requests)
    assert audit["copies"] == 0 and audit["copy_tokens"] == 0


def test_failed_and_unplaced_requests_are_left_out_and_chainless_workloads_give_nothing() -> None:
    requests = workload([DOC, DOC])
    records = [served(0, "r0", 0.0, 1024, 0), served(1, None, 1.0, 1024, 0), served(1, "r1", 2.0, 1024, 0, 503)]
    assert copies_audit(records, requests)["copies"] == 0
    chainless = [Request(0, 0.0, "completions", {"prompt": ""}, 1, 1024, 0)]
    assert copies_audit([served(0, "r0", 0.0, 1024, 0)], chainless) == {}


def test_report_lines_state_the_net() -> None:
    summary = {"copies": 2.0, "copy_tokens": 2048.0, "copy_cost_ms": 100.0, "copy_saved_tokens": 4096.0,
               "copy_saved_ms": 180.0, "warmup_saved_tokens": 0.0, "warmup_saved_ms": 0.0}
    lines = copies_lines({"cost": summary, "round_robin": {"copies": 0.0, "warmup_saved_tokens": 0.0}})
    assert len([line for line in lines if line.startswith("- ")]) == 1
    assert "net +80 ms" in lines[-1]
