"""Which replica each client session last went to (``X-Session-ID``), for the cost policy's soft session bonus.

Kept per cache salt as well as session id (a tenant's own), so no tenant can read or overwrite another's session by
sending its id. Each tenant has its own bounded memory (``limits.max_sessions_per_tenant``), least recently used
forgotten first: one tenant's stream of fresh session ids evicts only its own sessions, and the memory's size is
bounded by the configured tenants (session ids themselves are bounded by ``limits.max_id_chars``).
"""

from __future__ import annotations

from collections import OrderedDict


class SessionMemory:
    def __init__(self, capacity_per_tenant: int) -> None:
        self.capacity_per_tenant = capacity_per_tenant
        """Replaced on reload; a smaller one takes effect as each tenant's next session is remembered."""
        self._by_tenant: dict[str | None, OrderedDict[tuple[str | None, str], str]] = {}

    def reconfigure(self, capacity_per_tenant: int) -> None:
        self.capacity_per_tenant = capacity_per_tenant

    def last_replica(self, tenant: str | None, cache_salt: str | None, session_id: str | None) -> str | None:
        if not session_id:
            return None
        sessions = self._by_tenant.get(tenant)
        return None if sessions is None else sessions.get((cache_salt, session_id))

    def remember(self, tenant: str | None, cache_salt: str | None, session_id: str, replica: str) -> None:
        sessions = self._by_tenant.get(tenant)
        if sessions is None:
            sessions = self._by_tenant[tenant] = OrderedDict()
        session = (cache_salt, session_id)
        sessions[session] = replica
        sessions.move_to_end(session)
        while len(sessions) > self.capacity_per_tenant:
            sessions.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(sessions) for sessions in self._by_tenant.values())
