"""Dispatched prefill work that peer gateways report, per replica.

A gateway counts its own requests still prefilling on each replica exactly (the fleet's load tickets); its peers'
it learns only from the engine's scraped waiting queue, which misses a prefill already running and costs each queued
request at a mean size. With ``peers.hints``, every gateway also publishes its own per-replica prefill work (tokens
and requests) a few times a second, and each receiver adds its peers' to its own when it estimates a replica's
queue.

A peer's report replaces its previous one and counts until ``peers.hints.work_ttl_s`` after it was sent (the
gateways' wall clocks): a peer that stops reporting (gone, partitioned, restarted under a new instance id) stops
counting within that time, and routing falls back to the gateway's own view.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

MAX_REPORTED_REPLICAS = 4096
"""More replicas than this in one report is no report a gateway sends."""
MAX_PREFILL_TOKENS = 1 << 31
MAX_PREFILLING = 1 << 16


@dataclass(slots=True)
class _Share:
    sent_at: float
    expires_at: float
    by_replica: dict[str, tuple[int, int]] = field(default_factory=dict)


class PeerWork:
    """The latest unexpired work report of every peer (see the module docstring)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._shares: dict[str, _Share] = {}

    def update(self, sender: str, sent_at: float, loads: Mapping[str, tuple[int, int]]) -> bool:
        """Take ``sender``'s report (replica → (prefill tokens, requests prefilling)); False when it is refused:
        past its time-to-live, from the future, older than the report in force, or out of bounds."""
        now = self.clock()
        if not (now - self.ttl_s < sent_at <= now + self.ttl_s) or len(loads) > MAX_REPORTED_REPLICAS:
            return False
        current = self._shares.get(sender)
        if current is not None and current.sent_at >= sent_at and current.expires_at > now:
            return False  # reordered or replayed: the newer report stands
        by_replica: dict[str, tuple[int, int]] = {}
        for replica, (tokens, prefilling) in loads.items():
            if not (0 <= tokens < MAX_PREFILL_TOKENS and 0 <= prefilling < MAX_PREFILLING):
                return False
            if prefilling:
                by_replica[replica] = (tokens, prefilling)
        self._shares[sender] = _Share(sent_at, sent_at + self.ttl_s, by_replica)
        return True

    def prefill(self, replica: str) -> tuple[int, int]:
        """Prefill tokens and requests the peers have in flight on ``replica``, as far as their reports still
        count."""
        if not self._shares:
            return 0, 0
        now = self.clock()
        tokens = prefilling = 0
        expired: list[str] = []
        for sender, share in self._shares.items():
            if share.expires_at <= now:
                expired.append(sender)
                continue
            work = share.by_replica.get(replica)
            if work is not None:
                tokens += work[0]
                prefilling += work[1]
        for sender in expired:
            del self._shares[sender]
        return tokens, prefilling

    def peers(self) -> int:
        """Peers whose report still counts."""
        now = self.clock()
        return sum(1 for share in self._shares.values() if share.expires_at > now)
