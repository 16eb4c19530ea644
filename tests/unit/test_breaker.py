"""Circuit breaker state machine: closed → open after N consecutive failures → half-open after open_s admits one
probe → its success closes, its failure reopens."""

from __future__ import annotations

from kvgate.router.upstream.breaker import CircuitBreaker
from kvgate.router.upstream.config import BreakerConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(failures: int = 3, open_s: float = 10.0) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerConfig(failures_to_open=failures, open_s=open_s), clock), clock


def test_opens_only_after_consecutive_failures() -> None:
    b, _ = make(failures=3)
    b.record_failure()
    b.record_failure()
    b.record_success()  # streak broken
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow()


def test_half_open_admits_exactly_one_probe_and_success_closes() -> None:
    b, clock = make(failures=1, open_s=10)
    b.record_failure()
    clock.now += 9.9
    assert b.state == "open" and not b.allow()
    clock.now += 0.1
    assert b.state == "half_open"
    assert b.allow() and b.allow()  # asking does not use up the probe
    b.on_dispatch()
    assert not b.allow()  # the probe is out: nobody else is admitted
    b.record_success()
    assert b.state == "closed" and b.allow() and b.consecutive_failures == 0


def test_failed_probe_reopens_for_a_doubled_period() -> None:
    b, clock = make(failures=2, open_s=5)
    b.record_failure()
    b.record_failure()
    clock.now += 5
    b.on_dispatch()
    b.record_failure()
    assert b.state == "open" and not b.allow()
    clock.now += 9.9
    assert b.state == "open"
    clock.now += 0.1
    assert b.state == "half_open" and b.allow()


def test_success_of_an_old_request_does_not_close_an_open_circuit() -> None:
    b, _ = make(failures=1)
    b.record_failure()
    b.record_success()
    assert b.state == "open"


def test_dispatch_while_closed_takes_no_probe_and_reset_forgets() -> None:
    b, clock = make(failures=1, open_s=1)
    b.on_dispatch()
    b.record_failure()
    assert b.state == "open"
    b.reset()
    assert b.state == "closed" and b.allow()
    clock.now += 100
    assert b.state == "closed"


def test_thresholds_follow_a_reloaded_config() -> None:
    b, _ = make(failures=5)
    b.config = BreakerConfig(failures_to_open=1, open_s=1)
    b.record_failure()
    assert b.state == "open"
