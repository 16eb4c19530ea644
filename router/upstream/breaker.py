"""Passive health: a per-replica circuit breaker fed by the outcome of real requests.

Active health checks run every few seconds; a replica can start failing requests long before a check notices. The
breaker opens after ``failures_to_open`` consecutive request failures blamed on the replica (which ones are is the
proxy's rule: a connection refused at once, a timeout or 5xx once the same request succeeded on another replica),
rejects for ``open_s``, then goes half-open and admits exactly one probe request: its success closes the circuit,
its failure reopens it, and an answer that proves neither (the request failed everywhere, or was the client's
mistake) frees the probe slot for the next one. As Envoy's outlier detection ejects, each opening without a recovery
in between lasts twice the previous one, up to ``max_open_s``; a circuit that stayed closed for ``max_open_s``
starts again from ``open_s``.

One caller must not be able to eject replicas that serve everyone: the failures of a streak must come from at least
``min_callers_to_open`` distinct callers (tenants), or from every caller that sent the replica requests lately when
fewer did; and the fleet may refuse an opening (``may_open``) that would eject more of it than
``breaker.max_ejected_fraction`` (Envoy's ``max_ejection_percent``).

``allow()`` is a pure question (policies ask it for every candidate on every request); the probe slot is taken only
when a request is actually dispatched (``on_dispatch``), so looking at a half-open replica never uses up its probe.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

from kvgate.router.upstream.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]

RECENT_CALLERS_S = 60.0
"""A caller counts as one of the replica's recent callers for this long after its last request there."""
MAX_RECENT_CALLERS = 16
"""Recent callers remembered per replica; more than any ``min_callers_to_open`` needs."""


class CircuitBreaker:
    def __init__(
        self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic,
        may_open: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self._clock = clock
        self._may_open = may_open
        self._recent_callers: dict[str | None, float] = {}
        """Who sent this replica requests lately (tenant, or None without tenants), and when last."""
        self._streak_callers: set[str | None] = set()
        """Whose requests the failures of the current streak were."""
        self._consecutive_failures = 0
        self._opened_at: float | None = None
        self._probe_in_flight = False
        self._openings = 0
        """Openings since the circuit last stayed closed for ``max_open_s``: the next one lasts open_s × 2^openings."""
        self._closed_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.open_for_s:
            return "half_open"
        return "open"

    @property
    def open_for_s(self) -> float:
        """How long the current (or next) opening rejects."""
        cfg = self.config
        return min(cfg.max_open_s, cfg.open_s * 2 ** max(0, self._openings - 1))

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    def allow(self) -> bool:
        """Closed, or half-open with its single probe slot still free."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._probe_in_flight)

    def on_dispatch(self, caller: str | None = None) -> None:
        """A request of ``caller`` was sent to the replica: in half-open state it is the probe, and no other is
        admitted."""
        callers = self._recent_callers
        if caller in callers or len(callers) < MAX_RECENT_CALLERS:
            callers[caller] = self._clock()
        else:  # full: the least recently seen caller makes room
            del callers[min(callers, key=callers.__getitem__)]
            callers[caller] = self._clock()
        if self.state == "half_open":
            self._probe_in_flight = True

    def record_success(self) -> None:
        """Any success proves the replica serves again: close (an open circuit waits for its probe instead)."""
        if self.state == "open":
            return
        if self._opened_at is not None:
            self._closed_at = self._clock()
        self._consecutive_failures = 0
        self._streak_callers.clear()
        self._opened_at = None
        self._probe_in_flight = False

    def record_inconclusive(self) -> None:
        """A request that proves nothing about the replica ended (it failed everywhere, or the engine refused what
        the client sent): a half-open circuit's probe slot is free again."""
        if self.state == "half_open":
            self._probe_in_flight = False

    def record_failure(self, caller: str | None = None) -> None:
        """A failure blamed on the replica, of a request ``caller`` sent."""
        state = self.state
        if state == "half_open":
            self._open()
            return
        self._consecutive_failures += 1
        self._streak_callers.add(caller)
        if state == "closed" and self._consecutive_failures >= self.config.failures_to_open \
                and len(self._streak_callers) >= self._callers_needed() and self._may_open():
            self._open()

    def _callers_needed(self) -> int:
        """Distinct callers a streak needs: ``min_callers_to_open``, or all the replica's recent callers if fewer."""
        now = self._clock()
        recent = sum(1 for seen in self._recent_callers.values() if now - seen < RECENT_CALLERS_S)
        return max(1, min(self.config.min_callers_to_open, recent))

    def reset(self) -> None:
        """Forget all history (the replica restarted or recovered from a failed health check)."""
        self._consecutive_failures = 0
        self._streak_callers.clear()
        self._opened_at = None
        self._probe_in_flight = False
        self._openings = 0
        self._closed_at = None

    def _open(self) -> None:
        now = self._clock()
        if self._closed_at is not None and now - self._closed_at >= self.config.max_open_s:
            self._openings = 0
        self._openings += 1
        self._opened_at = now
        self._probe_in_flight = False
        self._streak_callers.clear()
