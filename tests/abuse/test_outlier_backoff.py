"""Passive outlier detection: a replica that keeps failing is ejected for longer each time (exponential back-off)."""

from __future__ import annotations

from kvgate.router.upstream.breaker import CircuitBreaker
from kvgate.router.upstream.config import BreakerConfig
from tests.support import ManualClock


def test_each_ejection_without_recovery_lasts_twice_as_long_up_to_the_cap() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(BreakerConfig(failures_to_open=2, open_s=1.0, max_open_s=5.0), clock)
    breaker.record_failure()
    breaker.record_failure()
    lengths = []
    for _ in range(5):
        assert breaker.state == "open"
        opened = clock.now
        while breaker.state == "open":
            clock.now += 0.25
        lengths.append(clock.now - opened)
        breaker.on_dispatch()
        breaker.record_failure()  # the half-open probe fails: ejected again
    assert lengths == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_recovery_that_lasts_resets_the_back_off() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(BreakerConfig(failures_to_open=1, open_s=1.0, max_open_s=5.0), clock)
    breaker.record_failure()
    clock.now = 1.0
    breaker.on_dispatch()
    breaker.record_failure()
    assert breaker.open_for_s == 2.0
    clock.now = 3.0
    breaker.on_dispatch()
    breaker.record_success()  # closed again
    assert breaker.state == "closed"
    clock.now = 3.5
    breaker.record_failure()  # soon after: the back-off continues
    assert breaker.open_for_s == 4.0
    clock.now = 7.5
    breaker.on_dispatch()
    breaker.record_success()
    clock.now = 13.0  # closed for longer than max_open_s
    breaker.record_failure()
    assert breaker.open_for_s == 1.0
