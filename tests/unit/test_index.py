"""PrefixIndex: longest contiguous prefix per replica, tier attribution, predictions, generations, eviction."""

from __future__ import annotations

import pytest

from kvgate.cache_index.index import PrefixIndex, Survivors
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch, Tier
from tests.index_inspection import tiers_of
from tests.support import ManualClock

BS = 4


def keys(n: int, namespace: str = "m") -> list[int]:
    return block_keys(namespace_key(namespace), list(range(n * BS)), BS)


def test_longest_contiguous_prefix_stops_at_first_missing_block() -> None:
    index = PrefixIndex()
    k = keys(6)
    index.store("a", k[:4], Tier.GPU, 0)
    index.store("b", k[:2] + k[3:], Tier.GPU, 0)
    index.store("c", k[1:], Tier.GPU, 0)  # no block 0: nothing usable
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=16), "b": PrefixMatch(gpu=8)}
    assert index.lookup([], BS) == {}


def test_each_block_counts_in_its_best_tier() -> None:
    index = PrefixIndex()
    k = keys(5)
    index.store("a", k[:2], Tier.GPU, 0)
    index.store("a", k[1:4], Tier.CPU, 0)
    index.store("a", k[3:5], Tier.STORAGE, 0)
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=8, cpu=8, storage=4)}
    assert tiers_of(index, "a", k[3]) == [Tier.CPU, Tier.STORAGE]
    index.remove("a", k[:1], Tier.GPU)
    assert index.lookup(k, BS) == {}
    index.remove("a", k[1:2], Tier.GPU)
    assert index.stats().entries == 5  # 2 + 3 + 2 stored, 2 removed


def test_store_is_idempotent() -> None:
    index = PrefixIndex()
    k = keys(3)
    index.store("a", k, Tier.GPU, 0)
    index.store("a", k, Tier.GPU, 0)
    assert index.stats().entries == 3
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=12)}


def test_new_generation_replaces_holdings_and_old_generation_is_ignored() -> None:
    index = PrefixIndex()
    k = keys(3)
    index.store("a", k, Tier.GPU, 1)
    index.store("a", k[:1], Tier.GPU, 2)
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=4)}
    index.store("a", k, Tier.GPU, 1)
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=4)}
    assert index.generation("a") == 2


def test_drop_replica_removes_only_its_holdings() -> None:
    index = PrefixIndex()
    k = keys(3)
    index.store("a", k, Tier.GPU, 0)
    index.store("a", k, Tier.CPU, 0)
    index.store("b", k[:2], Tier.GPU, 0)
    assert index.drop_replica("a") == 6
    assert index.lookup(k, BS) == {"b": PrefixMatch(gpu=8)}
    assert index.stats().entries == 2
    index.store("c", k, Tier.GPU, 0)  # reuses a's slot: must not inherit anything
    assert index.lookup(k, BS) == {"b": PrefixMatch(gpu=8), "c": PrefixMatch(gpu=12)}


def test_namespaces_are_isolated() -> None:
    index = PrefixIndex()
    tenant_a = block_keys(namespace_key("m", cache_salt="a"), list(range(16)), BS)
    tenant_b = block_keys(namespace_key("m", cache_salt="b"), list(range(16)), BS)
    index.store("r", tenant_a, Tier.GPU, 0)
    assert index.lookup(tenant_b, BS) == {}
    assert index.lookup(tenant_a, BS) == {"r": PrefixMatch(gpu=16)}


def test_predictions_count_until_ttl_and_are_confirmed_by_stores() -> None:
    clock = ManualClock(100.0)
    index = PrefixIndex(predicted_ttl_s=2.0, clock=clock)
    k = keys(4)
    index.store("a", k[:1], Tier.GPU, 0)
    index.predict("a", k)
    index.predict("b", k[:2])
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=4, predicted=12), "b": PrefixMatch(predicted=8)}
    assert index.stats().predicted_entries == 5
    clock.now += 1.0
    index.store("a", k[:2], Tier.GPU, 0)
    assert index.lookup(k, BS)["a"] == PrefixMatch(gpu=8, predicted=8)
    clock.now += 1.0  # TTL reached: never trusted past it
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=8)}
    assert index.stats().predicted_entries == 0


def test_a_repeated_prediction_extends_the_ttl() -> None:
    clock = ManualClock(100.0)
    index = PrefixIndex(predicted_ttl_s=2.0, clock=clock)
    k = keys(2)
    index.predict("a", k)
    clock.now += 1.5
    index.predict("a", k)
    clock.now += 1.0
    assert index.lookup(k, BS) == {"a": PrefixMatch(predicted=8)}
    clock.now += 1.0
    assert index.lookup(k, BS) == {}


def test_cap_evicts_least_recently_matched_chains_from_their_leaves() -> None:
    index = PrefixIndex(max_entries=8)
    old, new = keys(4, "old"), keys(4, "new")
    index.store("a", old, Tier.GPU, 0)
    index.store("a", new, Tier.GPU, 0)
    index.lookup(old, BS)  # old is now the most recently matched chain
    third = keys(2, "third")
    index.store("a", third, Tier.GPU, 0)
    stats = index.stats()
    assert stats.entries == 8 and stats.evictions == 2
    assert index.lookup(old, BS) == {"a": PrefixMatch(gpu=16)}
    assert index.lookup(new, BS) == {"a": PrefixMatch(gpu=8)}  # its two leaf blocks went first
    assert index.lookup(third, BS) == {"a": PrefixMatch(gpu=8)}


def test_invalid_cap() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_entries=0)


def test_reset_replica_starts_a_generation_and_keeps_later_predictions() -> None:
    index = PrefixIndex()
    k = keys(2)
    index.store("a", k, Tier.GPU, 0)
    assert index.reset_replica("a", 1) == 2
    index.predict("a", k)
    index.store("a", k[:1], Tier.GPU, 1)
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=4, predicted=4)}
    index.store("a", k, Tier.GPU, 0)  # late write of the old generation
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=4, predicted=4)}


def test_dropped_slots_are_swept_before_reuse_and_counts_stay_exact() -> None:
    index = PrefixIndex(max_entries=1_000)
    k = keys(3)
    index.store("keeper", k[:1], Tier.GPU, 0)
    for generation in range(20):  # more drops than retired slots kept before a sweep
        index.store("flappy", k, Tier.CPU, generation)
        index.predict("other", k)
        assert index.lookup(k, BS)["flappy"] == PrefixMatch(cpu=12)
        assert index.stats().entries == 4
        index.reset_replica("flappy", generation + 1)
        index.drop_replica("other")
        assert index.lookup(k, BS) == {"keeper": PrefixMatch(gpu=4)}
        assert index.stats().entries == 1
    index.sweep()
    assert index.stats().blocks == 1


def test_eviction_counts_only_live_holdings() -> None:
    index = PrefixIndex(max_entries=4)
    k = keys(6)
    index.store("a", k[:4], Tier.GPU, 0)
    index.drop_replica("a")  # retired, not yet swept: its bits linger in the masks
    index.store("b", k[:4], Tier.GPU, 0)
    assert index.stats().entries == 4 and index.stats().evictions == 0
    index.store("b", k[4:6], Tier.GPU, 0)
    stats = index.stats()
    assert stats.entries == 4 and stats.evictions == 2
    assert index.lookup(k, BS) == {"b": PrefixMatch(gpu=8)}  # the first chain lost its two leaves


def test_a_shorter_prediction_expires_first_and_never_shortens_a_longer_one() -> None:
    now = [0.0]
    index = PrefixIndex(predicted_ttl_s=2.0, clock=lambda: now[0])
    index.predict("a", [1, 2])
    index.predict("b", [1, 2], ttl_s=0.5)
    index.predict("a", [1, 2], ttl_s=0.5)
    now[0] = 1.0
    found = index.lookup([1, 2], 4)
    assert set(found) == {"a"} and found["a"].predicted == 8
    index.predict("b", [1, 2], ttl_s=60.0)  # never longer than this index's own TTL
    now[0] = 3.5
    assert index.lookup([1, 2], 4) == {}


def test_a_full_cache_loses_its_least_recently_used_tail_first() -> None:
    """On a full replica the next allocations evict its least recently stored or dispatched blocks, chain tails
    first: a match is cut at its first block within the reach of the blocks still to be allocated there."""
    index = PrefixIndex()
    old = block_keys(namespace_key("m"), list(range(100, 100 + 4 * BS)), BS)
    hot = block_keys(namespace_key("m"), list(range(200, 200 + 4 * BS)), BS)
    index.store("a", old, Tier.GPU, 0)
    index.store("a", hot, Tier.GPU, 0)
    # Room for 8 more blocks: nothing is at risk yet.
    assert index.surviving_blocks("a", old, capacity_blocks=16, incoming_blocks=8).blocks == 4
    # 2 blocks beyond the free ones: the old chain's last two go (tail first), the recent chain keeps all.
    assert index.surviving_blocks("a", old, capacity_blocks=16, incoming_blocks=10).blocks == 2
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=10).blocks == 4
    # A dispatch of the old prompt makes it the most recent: now the other chain's tail is at risk.
    index.touch("a", old)
    assert index.surviving_blocks("a", old, capacity_blocks=16, incoming_blocks=10).blocks == 4
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=10).blocks == 2
    # Once the engine has evicted in this generation it has no never-used blocks left, whatever kvgate knows of.
    index.evicted("a")
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=2).blocks == 2
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=8).blocks == 0
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=0).blocks == 4
    # Removed and forgotten blocks leave the order; a new generation has not evicted yet.
    index.remove("a", hot[3:], Tier.GPU)
    assert index.surviving_blocks("a", old, capacity_blocks=16, incoming_blocks=4).blocks == 3
    index.reset_replica("a", 1, wiped=True)  # a restart or a cache reset: never-used blocks again
    index.store("a", hot, Tier.GPU, 1)
    assert index.surviving_blocks("a", hot, capacity_blocks=16, incoming_blocks=12).blocks == 4
    # A replica kvgate knows nothing of: not ours to cut.
    assert index.surviving_blocks("b", hot, capacity_blocks=16, incoming_blocks=100).blocks == 4


def test_a_block_at_risk_on_the_gpu_survives_in_a_lower_tier_that_holds_it() -> None:
    """An offloading engine keeps a copy of its blocks in its CPU (or storage) tier: the GPU copy's eviction leaves
    the block reusable, loaded from there, so the prefix is cut only at a block at risk that no lower tier holds."""
    index = PrefixIndex()
    old = block_keys(namespace_key("m"), list(range(100, 100 + 4 * BS)), BS)
    hot = block_keys(namespace_key("m"), list(range(200, 200 + 4 * BS)), BS)
    index.store("a", old, Tier.GPU, 0)
    index.store("a", hot, Tier.GPU, 0)
    index.evicted("a")
    index.store("a", old[:3], Tier.CPU, 0)
    index.store("a", old[:1], Tier.STORAGE, 0)
    # The old chain is wholly at risk on the GPU: its first three blocks stay, loaded from the CPU (the faster of
    # the two tiers holding the first); the fourth is held nowhere else.
    assert index.surviving_blocks("a", old, capacity_blocks=8, incoming_blocks=4) == Survivors(3, 3, 0)
    index.store("a", hot[:2], Tier.STORAGE, 0)
    assert index.surviving_blocks("a", hot, capacity_blocks=8, incoming_blocks=8) == Survivors(2, 0, 2)
    # Out of reach of the allocations, a block stays on the GPU even where a lower tier holds it too.
    assert index.surviving_blocks("a", hot, capacity_blocks=8, incoming_blocks=4) == Survivors(4)


def test_unconfirmed_predictions_count_as_blocks_still_to_allocate() -> None:
    """A prompt sent to a replica whose BlockStored has not arrived: its blocks, and what they evict, are not applied
    yet, even when the router no longer counts the request as prefilling."""
    index = PrefixIndex(clock=ManualClock(100.0))
    old = block_keys(namespace_key("m"), list(range(100, 100 + 4 * BS)), BS)
    new = block_keys(namespace_key("m"), list(range(300, 300 + 3 * BS)), BS)
    index.store("a", old, Tier.GPU, 0)
    index.evicted("a")
    assert index.surviving_blocks("a", old, capacity_blocks=4, incoming_blocks=0).blocks == 4
    index.predict("a", new)
    assert index.surviving_blocks("a", old, capacity_blocks=4, incoming_blocks=0).blocks == 1
    index.store("a", new, Tier.GPU, 0)  # confirmed (the same batch carried the evictions)
    assert index.surviving_blocks("a", old, capacity_blocks=4, incoming_blocks=0).blocks == 4


def test_a_replica_that_was_evicting_still_is_after_a_reset_that_kept_its_cache() -> None:
    """kvgate forgets at a health loss, but the engine keeps its full cache: it still evicts on every allocation.
    Only a restart or a cache reset empties it."""
    index = PrefixIndex()
    k = keys(4)
    index.store("a", k, Tier.GPU, 0)
    index.evicted("a")
    index.reset_replica("a", 1)
    index.store("a", k, Tier.GPU, 1)
    assert index.surviving_blocks("a", k, capacity_blocks=100, incoming_blocks=2).blocks == 2
    index.reset_replica("a", 2, wiped=True)
    index.store("a", k, Tier.GPU, 2)
    assert index.surviving_blocks("a", k, capacity_blocks=100, incoming_blocks=2).blocks == 4


def test_unpredict_drops_predictions_and_keeps_confirmed_blocks() -> None:
    index = PrefixIndex(predicted_ttl_s=10.0)
    k = keys(4)
    index.store("a", k[:2], Tier.GPU, 0)
    index.predict("a", k)
    index.predict("b", k)
    index.unpredict("a", k[1:])
    assert index.lookup(k, BS) == {"a": PrefixMatch(gpu=8), "b": PrefixMatch(predicted=16)}
    assert index.stats().predicted_entries == 4
    index.unpredict("c", k)  # a replica never seen: nothing to drop


def test_holdings_count_each_tier_and_the_live_predictions() -> None:
    """The operator's counts (``/admin/state``) follow stores, removals, eviction and drops, checked against a walk of
    the whole index, and predictions count until they expire."""
    clock = ManualClock(100.0)
    index = PrefixIndex(max_entries=40, predicted_ttl_s=2.0, clock=clock)
    assert index.holdings("a") == {"gpu_blocks": 0, "cpu_blocks": 0, "storage_blocks": 0, "predicted_blocks": 0}

    def walked(replica: str) -> dict[str, int]:
        counts = {f"{tier.name.lower()}_blocks": 0 for tier in Tier}
        exported = index.export_holdings([replica]).get(replica)
        for bits in (exported[1] if exported else b""):
            for tier in Tier:
                counts[f"{tier.name.lower()}_blocks"] += bits >> tier & 1
        return counts

    def check(replica: str) -> None:
        held = index.holdings(replica)
        assert {k: v for k, v in held.items() if k != "predicted_blocks"} == walked(replica)

    k = keys(30)
    index.store("a", k[:10], Tier.GPU, 0)
    index.store("a", k[5:15], Tier.CPU, 0)
    index.store("b", k[:8], Tier.STORAGE, 0)
    index.remove("a", k[:3], Tier.GPU)
    index.remove("a", k[:3], Tier.GPU)  # twice: counted once
    check("a"), check("b")
    assert index.holdings("a")["gpu_blocks"] == 7 and index.holdings("a")["cpu_blocks"] == 10
    index.predict("b", k[20:25])
    assert index.holdings("b")["predicted_blocks"] == 5
    index.store("b", k[20:22], Tier.GPU, 0)  # two confirmed
    assert index.holdings("b")["predicted_blocks"] == 3
    clock.now += 3.0
    assert index.holdings("b")["predicted_blocks"] == 0  # expired, whether or not a lookup swept them
    index.store("c", k[:30], Tier.GPU, 0)  # over max_entries: evicts
    for replica in ("a", "b", "c"):
        check(replica)
    assert index.stats().evictions > 0
    assert sum(sum(index.holdings(r)[f"{t.name.lower()}_blocks"] for t in Tier) for r in "abc") == index.stats().entries
    index.drop_replica("a")
    assert index.holdings("a") == {"gpu_blocks": 0, "cpu_blocks": 0, "storage_blocks": 0, "predicted_blocks": 0}
    index.store("a", k[:2], Tier.CPU, 1)
    check("a")
