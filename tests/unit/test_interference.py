"""The waiting each prefill imposed on its replica's other requests, read from the engine's timeline."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.loadgen.interference import Timeline, imposed_waits


def test_arrivals_during_a_prefill_are_charged_to_it() -> None:
    # a prefills from 0 to 100; b arrives at 20 and c at 60, and both start when a is done: a held them up 80 + 40.
    waits = imposed_waits({
        "a": Timeline(0, 0, 100),
        "b": Timeline(20, 100, 150),
        "c": Timeline(60, 100, 180),
    })
    assert waits == {"a": pytest.approx(120), "b": 0.0, "c": 0.0}


def test_waiting_during_two_prefills_is_shared_between_them() -> None:
    # a and b prefill together from 0 to 100; c waits from 0 to 100: 50 each.
    waits = imposed_waits({"a": Timeline(0, 0, 100), "b": Timeline(0, 0, 100), "c": Timeline(0, 100, 110)})
    assert waits["a"] == pytest.approx(50) and waits["b"] == pytest.approx(50)


def test_waiting_while_no_prefill_runs_is_charged_to_none() -> None:
    # b waits from 0 to 200 (for KV, say) while a's prefill runs from 50 to 100 only.
    waits = imposed_waits({"a": Timeline(50, 50, 100), "b": Timeline(0, 200, 250)})
    assert waits["a"] == pytest.approx(50) and waits["b"] == 0.0


def test_requests_never_admitted_or_answered_are_left_out() -> None:
    waits = imposed_waits({"a": Timeline(0, 0, None), "b": Timeline(0, None, None), "c": Timeline(5, 10, 20)})
    assert waits == {"c": 0.0}


timelines = st.lists(
    st.tuples(st.floats(0, 1000), st.floats(0, 500), st.floats(0, 500)), max_size=30
).map(lambda spans: {str(i): Timeline(a, a + wait, a + wait + run) for i, (a, wait, run) in enumerate(spans)})


@given(timelines)
def test_imposed_waiting_never_exceeds_the_waiting_that_overlapped_prefills(spans: dict[str, Timeline]) -> None:
    """Each instant of waiting is charged once at most, so the charges add up to no more than the waiting."""
    waits = imposed_waits(spans)
    total_wait = sum(t.scheduled_ms - t.arrival_ms for t in spans.values())  # type: ignore[operator]
    assert all(w >= 0 for w in waits.values())
    assert sum(waits.values()) <= total_wait + 1e-6
