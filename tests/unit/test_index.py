"""PrefixIndex: longest contiguous prefix per replica, tier attribution, predictions, generations, eviction."""

from __future__ import annotations

import pytest

from cache_index.index import PrefixIndex
from cache_index.keys import block_keys, namespace_key
from cache_index.match import PrefixMatch, Tier

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
    assert index.tiers_of("a", k[3]) == [Tier.CPU, Tier.STORAGE]
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
    clock = FakeClock()
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
    clock = FakeClock()
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
