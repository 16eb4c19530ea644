"""The session memory: per cache salt, least recently used forgotten first."""

from __future__ import annotations

from kvgate.router.routing.sessions import SessionMemory


def test_a_session_is_remembered_per_cache_salt() -> None:
    memory = SessionMemory()
    memory.remember("tenant-a", "s1", "r0")
    assert memory.last_replica("tenant-a", "s1") == "r0"
    assert memory.last_replica("tenant-b", "s1") is None
    assert memory.last_replica("tenant-a", None) is None


def test_the_least_recently_used_session_is_forgotten_first() -> None:
    memory = SessionMemory(capacity=2)
    memory.remember(None, "s1", "r0")
    memory.remember(None, "s2", "r1")
    memory.remember(None, "s1", "r2")  # s1 is now the most recent
    memory.remember(None, "s3", "r0")
    assert [memory.last_replica(None, s) for s in ("s1", "s2", "s3")] == ["r2", None, "r0"]
