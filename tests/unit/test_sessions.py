"""The session memory: per tenant and cache salt, each tenant's bounded, least recently used forgotten first; and
how often each tenant's sessions come back."""

from __future__ import annotations

import pytest

from kvgate.router.routing.sessions import MIN_STARTS, SessionMemory
from tests.support import ManualClock


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


def test_sessions_count_as_coming_back_until_enough_started_then_fresh_ids_read_zero() -> None:
    clock = ManualClock()
    memory = SessionMemory(capacity_per_tenant=1000, clock=clock)
    for i in range(4 * MIN_STARTS):
        if i == MIN_STARTS - 1:
            assert memory.return_share("fresh-ids") == 1.0  # too few sessions to tell
        memory.remember("fresh-ids", None, f"s{i}", "r0")
        clock.now += 0.5
    assert memory.return_share("fresh-ids") == 0.0
    assert memory.return_share("unknown") == 1.0


def test_the_return_share_is_returns_per_start_at_most_one_and_per_tenant() -> None:
    clock = ManualClock()
    memory = SessionMemory(capacity_per_tenant=1000, clock=clock)
    for i in range(4 * MIN_STARTS):
        memory.remember("halves", None, f"s{i}", "r0")
        if i % 2:
            memory.remember("halves", None, f"s{i}", "r0")  # every other session comes back once
        for _ in range(5):
            memory.remember("chatty", None, f"c{i}", "r1")
        clock.now += 0.5
    assert memory.return_share("halves") == pytest.approx(0.5, abs=0.05)
    assert memory.return_share("chatty") == 1.0
