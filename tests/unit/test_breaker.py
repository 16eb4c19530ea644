"""Circuit breaker state machine: closed → open after N consecutive failures → half-open after open_s admits one
probe → its success closes, its failure reopens."""

from __future__ import annotations

from kvgate.router.upstream.breaker import CircuitBreaker
from kvgate.router.upstream.config import BreakerConfig
from tests.support import ManualClock


def make(failures: int = 3, open_s: float = 10.0) -> tuple[CircuitBreaker, ManualClock]:
    clock = ManualClock(50.0)
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


def test_one_callers_failures_do_not_open_a_circuit_others_use() -> None:
    clock = ManualClock(50.0)
    b = CircuitBreaker(BreakerConfig(failures_to_open=3, min_callers_to_open=2), clock)
    for caller in ("alice", "bob"):
        b.on_dispatch(caller)
    for _ in range(10):
        b.record_failure("bob")
    assert b.state == "closed"  # bob alone, though alice sends requests here too
    b.record_failure("alice")
    assert b.state == "open"


def test_a_replica_only_one_caller_uses_opens_on_that_callers_failures() -> None:
    clock = ManualClock(50.0)
    b = CircuitBreaker(BreakerConfig(failures_to_open=3, min_callers_to_open=2), clock)
    b.on_dispatch("alice")
    clock.now += 1
    for _ in range(3):
        b.record_failure("alice")
    assert b.state == "open"


def test_a_caller_seen_long_ago_is_no_longer_one_of_the_recent_callers() -> None:
    clock = ManualClock(50.0)
    b = CircuitBreaker(BreakerConfig(failures_to_open=2, min_callers_to_open=2), clock)
    b.on_dispatch("alice")
    clock.now += 3600
    b.on_dispatch("bob")
    b.record_failure("bob")
    b.record_failure("bob")
    assert b.state == "open"


def test_the_fleet_may_refuse_an_opening() -> None:
    allowed = [False]
    b = CircuitBreaker(BreakerConfig(failures_to_open=2), ManualClock(50.0), may_open=lambda: allowed[0])
    for _ in range(5):
        b.record_failure()
    assert b.state == "closed"
    allowed[0] = True
    b.record_failure()
    assert b.state == "open"


def test_an_inconclusive_answer_frees_the_half_open_probe() -> None:
    b, clock = make(failures=1, open_s=10)
    b.record_failure()
    clock.now += 10
    b.on_dispatch()
    assert not b.allow()
    b.record_inconclusive()  # the probe's request failed everywhere, or the engine refused it: no verdict
    assert b.state == "half_open" and b.allow()
