"""Dispatched work that peer gateways report, per replica: what the fleet adds to its own count in each view.

A gateway counts its own requests still prefilling on each replica exactly (the fleet's load tickets), and its own
dispatch rate there. Its peers' it learns otherwise only from the engine: the scraped waiting queue, which misses a
prefill already running and costs each queued request at a mean size, and the scraped finish rate, which trails the
arrivals while a queue builds. With ``peers.hints``, every gateway also publishes its own per-replica work (prefill
tokens, requests prefilling, dispatch rate) at each dispatch and a few times a second (:mod:`kvgate.router.peers.hints`
sends and receives them and writes what it receives here), and each receiver adds its peers' to its own when it
estimates a replica's queue and the arrivals a prefill there would hold up.

A peer's report replaces its previous one and counts until ``peers.hints.work_ttl_s`` after it was sent (the
gateways' wall clocks): a peer that stops reporting (gone, partitioned, restarted under a new instance id) stops
counting within that time, and routing falls back to the gateway's own view. A reported rate is used as sent, not
decayed further: rates move with a half-life of 10 s (``ARRIVAL_RATE_HALF_LIFE_S``), and a report counts for at most
``work_ttl_s`` (1 s by default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.router.fleet.tickets import NO_WORK, DispatchedWork

MAX_REPORTED_REPLICAS = 4096
"""More replicas than this in one report is no report a gateway sends."""
MAX_PREFILL_TOKENS = 1 << 31
MAX_PREFILLING = 1 << 16
MAX_ARRIVAL_RATE_PER_S = 1e6


@dataclass(slots=True)
class _Share:
    sent_at: float
    expires_at: float
    by_replica: dict[str, DispatchedWork] = field(default_factory=dict)


def in_bounds(work: DispatchedWork) -> bool:
    return (0 <= work.prefill_tokens < MAX_PREFILL_TOKENS and 0 <= work.prefilling < MAX_PREFILLING
            and 0.0 <= work.arrival_rate_per_s < MAX_ARRIVAL_RATE_PER_S and math.isfinite(work.arrival_rate_per_s))


class PeerWork:
    """The latest unexpired work report of every peer (see the module docstring)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._shares: dict[str, _Share] = {}

    def update(self, sender: str, sent_at: float, loads: Mapping[str, DispatchedWork]) -> bool:
        """Take ``sender``'s report; False when it is refused: past its time-to-live, from the future, older than
        the report in force, or out of bounds."""
        now = self.clock()
        if not (now - self.ttl_s < sent_at <= now + self.ttl_s) or len(loads) > MAX_REPORTED_REPLICAS:
            return False
        current = self._shares.get(sender)
        if current is not None and current.sent_at >= sent_at and current.expires_at > now:
            return False  # reordered or replayed: the newer report stands
        if not all(in_bounds(work) for work in loads.values()):
            return False
        by_replica = {replica: work for replica, work in loads.items() if work.prefilling or work.arrival_rate_per_s}
        self._shares[sender] = _Share(sent_at, sent_at + self.ttl_s, by_replica)
        return True

    def work(self, replica: str) -> DispatchedWork:
        """What the peers have dispatched to ``replica``, summed, as far as their reports still count."""
        if not self._shares:
            return NO_WORK
        now = self.clock()
        tokens = prefilling = 0
        rate = 0.0
        expired: list[str] = []
        for sender, share in self._shares.items():
            if share.expires_at <= now:
                expired.append(sender)
                continue
            work = share.by_replica.get(replica)
            if work is not None:
                tokens += work.prefill_tokens
                prefilling += work.prefilling
                rate += work.arrival_rate_per_s
        for sender in expired:
            del self._shares[sender]
        return DispatchedWork(tokens, prefilling, rate)

    def report_ages(self, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` peers whose report still counts, freshest first, with its age in seconds."""
        now = self.clock()
        live = sorted((now - share.sent_at, sender) for sender, share in self._shares.items() if share.expires_at > now)
        return [(sender, age) for age, sender in live[:limit]]

    def peers(self) -> int:
        """Peers whose report still counts."""
        now = self.clock()
        return sum(1 for share in self._shares.values() if share.expires_at > now)
