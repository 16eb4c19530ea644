"""The capacity term on constructed states: what a candidate's new blocks evict, and what that costs the fleet."""

from __future__ import annotations

import random

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import CacheMargin, ReplicaView, RouteRequest
from kvgate.policies.capacity import HeldPrefix, cache_margin, copy_eviction_ms, eviction_ms, free_tokens
from kvgate.policies.config import CostPolicyConfig, PrefillCost, ReplicationConfig, TransferConfig
from kvgate.policies.cost import CostPolicy
from kvgate.policies.cost_model import CostModel
from kvgate.policies.replication import HotPrefixTracker

PER_TOKEN = PrefillCost().per_token_ms
NOW = 1000.0
CAPACITY = 64_000
DOC = 10_000


def held(n: int, rate: float, oldest_age_s: float, holders: int = 1) -> list[HeldPrefix]:
    """``n`` documents of DOC tokens asked for at ``rate`` each, last used 0 .. ``oldest_age_s`` seconds ago."""
    return [HeldPrefix(DOC, rate, NOW - oldest_age_s * i / max(n - 1, 1), holders) for i in range(n)]


def replica(name: str, held_tokens: int, margin: CacheMargin | None, gpu: int = 0, **kw: object) -> ReplicaView:
    return ReplicaView(name=name, healthy=True, can_source=True, match=PrefixMatch(gpu=gpu),
                       kv_capacity_tokens=CAPACITY, kv_held_tokens=held_tokens, cache_margin=margin, **kw)


def test_empty_replica_costs_nothing() -> None:
    margin = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    empty = replica("r", held_tokens=0, margin=margin)
    assert free_tokens(empty) == CAPACITY
    assert eviction_ms(empty, DOC) == 0.0
    # Filling it up to its last free token still costs nothing; one block beyond does.
    almost = replica("r", held_tokens=CAPACITY - DOC, margin=margin)
    assert eviction_ms(almost, DOC) == 0.0 and eviction_ms(almost, DOC + 16) > 0.0


def test_full_replica_with_a_hot_tail_costs_a_recompute_per_evicted_token() -> None:
    # Six documents each asked for once a second, the oldest used 8 s ago: whatever is evicted comes back soon.
    margin = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    assert margin is not None and margin.residence_s == pytest.approx(8.0)
    assert margin.ms_per_token == pytest.approx(PER_TOKEN)
    full = replica("r", held_tokens=CAPACITY, margin=margin)
    assert eviction_ms(full, DOC) == pytest.approx(DOC * PER_TOKEN)  # ~350 ms: a whole document's prefill


def test_full_replica_with_a_cold_tail_costs_little() -> None:
    # The same holdings asked for once every 200 s: evicting them costs a few percent of a recompute.
    margin = cache_margin(held(6, rate=0.005, oldest_age_s=8.0), PER_TOKEN, NOW)
    assert margin is not None
    full = replica("r", held_tokens=CAPACITY, margin=margin)
    assert 0.0 < eviction_ms(full, DOC) < 0.05 * DOC * PER_TOKEN


def test_hot_prefixes_far_from_eviction_do_not_make_a_cold_tail_expensive() -> None:
    # A hot document used just now sits at the head of the LRU; the tail is an old cold one: cheap to evict.
    prefixes = [HeldPrefix(DOC, 2.0, NOW, 1), HeldPrefix(DOC, 0.002, NOW - 60.0, 1)]
    margin = cache_margin(prefixes, PER_TOKEN, NOW)
    assert margin is not None and margin.ms_per_token < 0.2 * PER_TOKEN


def test_a_prefix_held_elsewhere_too_is_cheaper_to_lose() -> None:
    alone = cache_margin(held(6, rate=0.05, oldest_age_s=8.0), PER_TOKEN, NOW)
    shared = cache_margin(held(6, rate=0.05, oldest_age_s=8.0, holders=4), PER_TOKEN, NOW)
    assert alone is not None and shared is not None and shared.ms_per_token < alone.ms_per_token


def test_unknown_capacity_or_nothing_known_held_costs_nothing() -> None:
    assert cache_margin([], PER_TOKEN, NOW) is None
    margin = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    unknown = ReplicaView(name="r", healthy=True, match=PrefixMatch(), cache_margin=margin)
    assert eviction_ms(unknown, DOC) == 0.0
    assert eviction_ms(replica("r", held_tokens=CAPACITY, margin=None), DOC) == 0.0


def test_in_flight_prefills_take_free_room() -> None:
    margin = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    busy = replica("r", held_tokens=CAPACITY - DOC, margin=margin, in_flight_prefilling=1,
                   in_flight_prefill_tokens=DOC)
    assert eviction_ms(busy, DOC) == pytest.approx(DOC * PER_TOKEN)


def test_only_the_copy_is_priced() -> None:
    """What a request stores wherever it goes (a cold prompt; a warm holder's uncached suffix) is not a copy: only
    the tokens beyond the fewest any replica must store are priced, at the margin, after the free room."""
    margin = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    full = replica("r", held_tokens=CAPACITY, margin=margin)
    assert copy_eviction_ms(full, DOC, DOC) == 0.0
    assert copy_eviction_ms(full, DOC + 128, 128) == pytest.approx(DOC * PER_TOKEN)
    # 4,000 tokens of room: the suffix takes 128 of them, the copy's first 3,872 fill the rest.
    roomy = replica("r", held_tokens=CAPACITY - 4_000, margin=margin)
    assert copy_eviction_ms(roomy, DOC + 128, 128) == pytest.approx((DOC + 128 - 4_000) * PER_TOKEN)


def cost_policy(**config: object) -> CostPolicy:
    model = CostModel(PrefillCost(), {}, TransferConfig(), 320 * 1024)
    return CostPolicy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0, **config), model,
                      random.Random(0))


def test_cost_waits_on_a_busy_holder_rather_than_displace_hot_documents() -> None:
    """A document's holder is busy enough that recomputing it on an idle replica would win on TTFT alone; the idle
    replica is full of documents asked for every second, so the copy would cost their next requests a recompute."""
    request = RouteRequest(request_id="r", model="m", prompt_tokens=DOC + 128, block_size=16)
    hot = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    holder = replica("holder", held_tokens=CAPACITY, margin=hot, gpu=DOC, in_flight_prefilling=4,
                     in_flight_prefill_tokens=4 * 2_000)
    idle_full = replica("idle", held_tokens=CAPACITY, margin=hot)
    idle_empty = replica("idle", held_tokens=0, margin=hot)
    assert cost_policy(eviction_weight=0.0).decide(request, [holder, idle_full]).replica == "idle"
    decision = cost_policy().decide(request, [holder, idle_full], explain=True)
    assert decision.replica == "holder"
    rows = decision.details["replicas"]
    # the copy is the document: the 128 new tokens are stored wherever the request goes
    assert rows["idle"]["eviction_ms"] == pytest.approx(DOC * PER_TOKEN)
    assert rows["idle"]["free_tokens"] == 0 and rows["idle"]["cache_margin"]["ms_per_token"] == pytest.approx(PER_TOKEN)
    # With free room the copy displaces nothing, and recomputing on the idle replica wins again.
    assert cost_policy().decide(request, [holder, idle_empty]).replica == "idle"


def test_cold_prompts_are_not_sent_to_the_busiest_replica_for_its_cheap_cache() -> None:
    """Both replicas are full. The busy one churns its cache (its tail is seldom asked for again), the quiet one
    holds documents asked for every second. A cold prompt evicts a prompt's worth of blocks wherever it goes, so
    what decides is the load, not which cache is cheaper to evict from: a cheap margin is what a busy replica has."""
    request = RouteRequest(request_id="r", model="m", prompt_tokens=DOC, block_size=16)
    cold_tail = cache_margin(held(6, rate=0.005, oldest_age_s=8.0), PER_TOKEN, NOW)
    hot_tail = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)
    busy = replica("busy", held_tokens=CAPACITY, margin=cold_tail, in_flight=3)  # three sequences decoding
    quiet = replica("quiet", held_tokens=CAPACITY, margin=hot_tail)
    for seed in range(10):
        policy = CostPolicy(CostPolicyConfig(), CostModel(PrefillCost(), {}, TransferConfig(), 320 * 1024),
                            random.Random(seed))
        decision = policy.decide(request, [busy, quiet], explain=True)
        assert (decision.replica, decision.reason) == ("quiet", "cold")
    assert decision.details["replicas"]["quiet"]["eviction_ms"] == 0.0


def test_warm_ups_pay_for_what_they_evict() -> None:
    """A hot prefix whose holder is the bottleneck is warmed on an idle replica with free room, not on one whose
    cache is full of documents asked for every second."""
    model = CostModel(PrefillCost(), {}, TransferConfig(), 320 * 1024)
    hot = cache_margin(held(6, rate=1.0, oldest_age_s=8.0), PER_TOKEN, NOW)

    def plan(target: ReplicaView) -> list[str]:
        tracker = HotPrefixTracker(ReplicationConfig())
        for i in range(100):
            tracker.record("p", DOC, {"holder"}, NOW + i * 0.1)
        holder = replica("holder", held_tokens=CAPACITY, margin=hot, in_flight_prefilling=3,
                         in_flight_prefill_tokens=3 * 4_000)
        return [w.target for w in tracker.plan([holder, target], model, NOW + 10.0)]

    assert plan(replica("idle", held_tokens=0, margin=hot)) == ["idle"]
    assert plan(replica("idle", held_tokens=CAPACITY, margin=hot)) == []


def test_tracker_margins_count_only_what_the_index_still_holds() -> None:
    model = CostModel(PrefillCost(), {}, TransferConfig(), 320 * 1024)
    tracker = HotPrefixTracker(ReplicationConfig(enabled=False))
    for i in range(20):
        tracker.record("hot", DOC, {"a", "b"}, NOW + i * 0.5)
    tracker.record("old", DOC, {"a"}, NOW)
    evicted_from_b = {("a", "hot"), ("a", "old")}
    margins = tracker.cache_margins(lambda replica, key: (replica, key) in evicted_from_b, model, NOW + 10.0)
    assert set(margins) == {"a"}  # b no longer holds anything the tracker knows of
    assert margins["a"].residence_s == pytest.approx(10.0)  # "old", last used 10 s ago, is the LRU tail
