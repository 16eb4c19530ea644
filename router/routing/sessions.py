"""Which replica each client session last went to (``X-Session-ID``), for the cost policy's soft session bonus, and
how often each tenant's sessions come back, for the price of a new session's later turns.

Kept per cache salt as well as session id (a tenant's own), so no tenant can read or overwrite another's session by
sending its id. Each tenant has its own bounded memory (``limits.max_sessions_per_tenant``), least recently used
forgotten first: one tenant's stream of fresh session ids evicts only its own sessions, and the memory's size is
bounded by the configured tenants (session ids themselves are bounded by ``limits.max_id_chars``). How often sessions
come back is counted per tenant too: one tenant's clients never change how another's new sessions are priced.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvgate.policies.rate import DecayedRate

RETURNS_HALF_LIFE_S = 300.0
"""Memory of how often a tenant's sessions come back: several sessions' lifetimes."""
MIN_STARTS = 16
"""Sessions a tenant starts before its own return share replaces the assumption that sessions come back."""


class SessionReturns:
    """A tenant's sessions started and requests of a session already seen, both decayed: their ratio, at most 1, is
    the share of sessions that come back (a client that sends a fresh id with every request reads 0)."""

    __slots__ = ("starts", "returns", "started")

    def __init__(self) -> None:
        self.starts = DecayedRate(RETURNS_HALF_LIFE_S)
        self.returns = DecayedRate(RETURNS_HALF_LIFE_S)
        self.started = 0

    def record(self, now: float, returning: bool) -> None:
        if returning:
            self.returns.add(now)
        else:
            self.starts.add(now)
            self.started += 1

    def share(self, now: float) -> float:
        """1 until ``MIN_STARTS`` sessions were seen; then returns per start, at most 1."""
        if self.started < MIN_STARTS:
            return 1.0
        starts = self.starts.per_s(now)
        return 1.0 if starts <= 0 else min(1.0, self.returns.per_s(now) / starts)


class SessionMemory:
    def __init__(self, capacity_per_tenant: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_per_tenant = capacity_per_tenant
        """Replaced on reload; a smaller one takes effect as each tenant's next session is remembered."""
        self.clock = clock
        self._by_tenant: dict[str | None, OrderedDict[tuple[str | None, str], str]] = {}
        self._returns: dict[str | None, SessionReturns] = {}

    def reconfigure(self, capacity_per_tenant: int) -> None:
        self.capacity_per_tenant = capacity_per_tenant

    def last_replica(self, tenant: str | None, cache_salt: str | None, session_id: str | None) -> str | None:
        if not session_id:
            return None
        sessions = self._by_tenant.get(tenant)
        return None if sessions is None else sessions.get((cache_salt, session_id))

    def return_share(self, tenant: str | None) -> float:
        """The share of ``tenant``'s recent sessions that came back after their first request (1 while it has
        started too few to tell)."""
        returns = self._returns.get(tenant)
        return 1.0 if returns is None else returns.share(self.clock())

    def remember(self, tenant: str | None, cache_salt: str | None, session_id: str, replica: str) -> None:
        sessions = self._by_tenant.get(tenant)
        if sessions is None:
            sessions = self._by_tenant[tenant] = OrderedDict()
        returns = self._returns.get(tenant)
        if returns is None:
            returns = self._returns[tenant] = SessionReturns()
        session = (cache_salt, session_id)
        returns.record(self.clock(), session in sessions)
        sessions[session] = replica
        sessions.move_to_end(session)
        while len(sessions) > self.capacity_per_tenant:
            sessions.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(sessions) for sessions in self._by_tenant.values())
