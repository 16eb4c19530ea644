"""Passive health: a per-replica circuit breaker fed by the outcome of real requests.

Active health checks run every few seconds; a replica can start failing requests long before a check notices. The
breaker opens after ``failures_to_open`` consecutive request failures (timeouts, connect errors, 5xx), rejects for
``open_s``, then goes half-open and admits exactly one probe request: its success closes the circuit, its failure
reopens it. As Envoy's outlier detection ejects, each opening without a recovery in between lasts twice the previous
one, up to ``max_open_s``; a circuit that stayed closed for ``max_open_s`` starts again from ``open_s``.

``allow()`` is a pure question (policies ask it for every candidate on every request); the probe slot is taken only
when a request is actually dispatched (``on_dispatch``), so looking at a half-open replica never uses up its probe.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

from kvgate.router.upstream.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
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

    def on_dispatch(self) -> None:
        """A request was sent to the replica: in half-open state it is the probe, and no other is admitted."""
        if self.state == "half_open":
            self._probe_in_flight = True

    def record_success(self) -> None:
        """Any success proves the replica serves again: close (an open circuit waits for its probe instead)."""
        if self.state == "open":
            return
        if self._opened_at is not None:
            self._closed_at = self._clock()
        self._consecutive_failures = 0
        self._opened_at = None
        self._probe_in_flight = False

    def record_failure(self) -> None:
        state = self.state
        if state == "half_open":
            self._open()
            return
        self._consecutive_failures += 1
        if state == "closed" and self._consecutive_failures >= self.config.failures_to_open:
            self._open()

    def reset(self) -> None:
        """Forget all history (the replica restarted or recovered from a failed health check)."""
        self._consecutive_failures = 0
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
