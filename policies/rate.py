"""A decayed event rate: how often something happened lately, in events per second, without keeping the events."""

from __future__ import annotations

import math


class DecayedRate:
    """An exponentially decayed count scaled to events per second.

    Each event adds ``ln 2 / half_life_s`` and the sum decays with that half-life, so a steady Poisson stream of ``ρ``
    events per second reads ``ρ`` and a stream that stopped halves every ``half_life_s``. O(1) memory and time:
    cheap enough to keep per replica and per prefix. Times are seconds on any monotonic clock; one that goes
    backwards is treated as no time passing.
    """

    __slots__ = ("_decay_per_s", "_value", "_updated")

    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._decay_per_s = math.log(2) / half_life_s
        self._value = 0.0
        self._updated: float | None = None

    def add(self, now: float, count: float = 1.0) -> None:
        """``count`` events happened at ``now``."""
        self._decay(now)
        self._value += count * self._decay_per_s

    def per_s(self, now: float) -> float:
        """The rate at ``now``."""
        self._decay(now)
        return self._value

    def _decay(self, now: float) -> None:
        updated = self._updated
        if updated is None or now > updated:
            if updated is not None and self._value:
                self._value *= math.exp(-self._decay_per_s * (now - updated))
            self._updated = now
