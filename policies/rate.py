"""A decayed event rate: how often something happened lately, in events per second, without keeping the events."""

from __future__ import annotations

import math


class DecayedRate:
    """An exponentially decayed count scaled to events per second.

    Each event adds ``ln 2 / half_life_s`` and the sum decays with that half-life, so a steady Poisson stream of ``ρ``
    events per second reads ``ρ`` and a stream that stopped halves every ``half_life_s``. O(1) memory and time:
    cheap enough to keep per replica and per prefix. Times are seconds on any monotonic clock; one that goes
    backwards is treated as no time passing.

    A plain decayed sum reads low for its first few half-lives: it counts the time before it was first used as time
    with no events (after one half-life of a steady stream it reads half the rate). With ``unbiased``, the sum is
    divided by the weight of the time observed so far, ``1 − e^{−k·t}`` (``t`` since the first ``add`` or ``per_s``,
    at least ``MIN_OBSERVED_FRACTION`` of a half-life so that a first event does not read as an unbounded rate):
    a steady stream reads its rate from the start. That suits a rate asked of every replica from the first request
    on (a replica that has had no arrivals reads zero either way); it does not suit a rate created by its own first
    event.
    """

    __slots__ = ("_decay_per_s", "_value", "_updated", "_first", "_min_observed_s")

    MIN_OBSERVED_FRACTION = 0.1

    def __init__(self, half_life_s: float, *, unbiased: bool = False) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._decay_per_s = math.log(2) / half_life_s
        self._value = 0.0
        self._updated: float | None = None
        self._first: float | None = None
        self._min_observed_s = half_life_s * self.MIN_OBSERVED_FRACTION if unbiased else None

    def add(self, now: float, count: float = 1.0) -> None:
        """``count`` events happened at ``now``."""
        self._decay(now)
        self._value += count * self._decay_per_s

    def per_s(self, now: float) -> float:
        """The rate at ``now``."""
        self._decay(now)
        if self._min_observed_s is None or self._first is None or not self._value:
            return self._value
        observed = max(now - self._first, self._min_observed_s)
        return self._value / -math.expm1(-self._decay_per_s * observed)

    def _decay(self, now: float) -> None:
        if self._first is None:
            self._first = now
        updated = self._updated
        if updated is None or now > updated:
            if updated is not None and self._value:
                self._value *= math.exp(-self._decay_per_s * (now - updated))
            self._updated = now
