"""The session memory: per tenant and cache salt, each tenant's bounded, least recently used forgotten first."""

from __future__ import annotations

from kvgate.router.routing.sessions import SessionMemory


def test_a_session_is_remembered_per_cache_salt() -> None:
    memory = SessionMemory(capacity_per_tenant=10)
    memory.remember("a", "salt-a", "s1", "r0")
    assert memory.last_replica("a", "salt-a", "s1") == "r0"
    assert memory.last_replica("a", "salt-b", "s1") is None
    assert memory.last_replica("b", "salt-a", "s1") is None
    assert memory.last_replica("a", "salt-a", None) is None


def test_the_least_recently_used_session_is_forgotten_first() -> None:
    memory = SessionMemory(capacity_per_tenant=2)
    memory.remember(None, None, "s1", "r0")
    memory.remember(None, None, "s2", "r1")
    memory.remember(None, None, "s1", "r2")  # s1 is now the most recent
    memory.remember(None, None, "s3", "r0")
    assert [memory.last_replica(None, None, s) for s in ("s1", "s2", "s3")] == ["r2", None, "r0"]


def test_one_tenants_fresh_sessions_evict_only_its_own() -> None:
    memory = SessionMemory(capacity_per_tenant=3)
    memory.remember("alice", "salt-a", "kept", "r0")
    for i in range(1000):
        memory.remember("bob", "salt-b", f"flood-{i}", "r1")
    assert memory.last_replica("alice", "salt-a", "kept") == "r0"
    assert len(memory) == 4
