"""Which replica each client session last went to (``X-Session-ID``), for the cost policy's soft session bonus.

Kept per cache salt as well as session id (a tenant's own), so no tenant can read or overwrite another's session by
sending its id. Least recently used sessions are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict

SESSION_MEMORY = 100_000
"""(cache salt, X-Session-ID) → last replica entries kept (least recently used forgotten first)."""


class SessionMemory:
    def __init__(self, capacity: int = SESSION_MEMORY) -> None:
        self.capacity = capacity
        self._last: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def last_replica(self, cache_salt: str | None, session_id: str | None) -> str | None:
        return self._last.get((cache_salt, session_id)) if session_id else None

    def remember(self, cache_salt: str | None, session_id: str, replica: str) -> None:
        session = (cache_salt, session_id)
        self._last[session] = replica
        self._last.move_to_end(session)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)
