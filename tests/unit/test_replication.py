"""Hot-prefix replication planning on constructed fleets: triggers, caps, budget, cooldown, retirement."""

from __future__ import annotations

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView
from kvgate.policies.config import PrefillCost, ReplicationConfig, TransferConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.replication import HotPrefixTracker

MODEL = CostModel(PrefillCost(), {"cpu": 0.015}, TransferConfig(), 320 * 1024)
PREFIX = 8000  # saves 0.035 x 8000 = 280 ms per request; 0.72 requests/s make it hot at 200 ms/s


def view(name: str, queued: int = 0, healthy: bool = True) -> ReplicaView:
    """``queued`` router requests of 1,000 uncached tokens each still prefilling (55 ms apiece)."""
    return ReplicaView(
        name=name,
        healthy=healthy,
        match=PrefixMatch(),
        in_flight=queued,
        in_flight_prefilling=queued,
        in_flight_prefill_tokens=queued * 1000,
    )


def feed(tracker: HotPrefixTracker, key: str, rate: float, seconds: float, holders: set[str], start: float = 0.0) -> float:
    """``rate`` requests/s for ``seconds``; returns the time of the last one."""
    now = start
    for i in range(int(rate * seconds)):
        now = start + i / rate
        tracker.record(key, PREFIX, holders, now)
    return now


BUSY_HOLDER = [view("a", queued=10), view("b"), view("c", queued=1)]  # a: 550 ms queue > 0 + 300 ms on b


def test_steady_stream_reads_as_its_rate() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(half_life_s=5))
    now = feed(tracker, "p", rate=4, seconds=60, holders={"a"})
    assert tracker.heat_ms_per_s("p", MODEL, now) == pytest.approx(4 * 280, rel=0.1)


def test_hot_prefix_with_busy_holder_warms_the_idlest_non_holder() -> None:
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    (warmup,) = tracker.plan(BUSY_HOLDER, MODEL, now)
    assert (warmup.prefix_key, warmup.target, warmup.source, warmup.via) == ("p", "b", "a", "prefill")
    assert warmup.prefix_tokens == PREFIX and warmup.saving_ms_per_s > 200
    assert tracker.counts[("started", "hot-prefix")] == 1


@pytest.mark.parametrize(
    "config, rate, seconds",
    [
        (ReplicationConfig(), 0.5, 60),  # a cold prefix: 140 ms/s < 200
        (ReplicationConfig(min_prefix_tokens=10_000), 5, 20),  # a hot prefix, but shorter than worth warming
    ],
    ids=["cold", "short"],
)
def test_a_prefix_not_worth_warming_is_not_replicated(config: ReplicationConfig, rate: float, seconds: int) -> None:
    tracker = HotPrefixTracker(config)
    now = feed(tracker, "p", rate=rate, seconds=seconds, holders={"a"})
    assert tracker.plan(BUSY_HOLDER, MODEL, now) == []


def test_hot_prefix_with_idle_enough_holder_is_not_replicated() -> None:
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    # a's 5 queued requests (275 ms) cost less than recomputing 8,000 tokens on b (300 ms).
    assert tracker.plan([view("a", queued=5), view("b")], MODEL, now) == []
    # Unhealthy replicas are neither holders to relieve nor targets.
    assert tracker.plan([view("a", queued=10), view("b", healthy=False)], MODEL, now) == []


def test_transfer_when_a_connector_makes_it_cheaper() -> None:
    nixl = CostModel(PrefillCost(), {}, TransferConfig(connector="nixl"), 320 * 1024)
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    (warmup,) = tracker.plan(BUSY_HOLDER, nixl, now)
    # 8,000 tokens: 12 + 109 ms on the link + one 20 ms step, against 300 ms of prefill on the target.
    assert (warmup.via, warmup.source) == ("transfer", "a")


def test_one_warmup_in_flight_per_prefix_then_next_after_confirmation() -> None:
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    fleet = [view("a", queued=10), view("b", queued=8), view("c")]
    assert [w.target for w in tracker.plan(fleet, MODEL, now)] == ["c"]
    assert tracker.plan(fleet, MODEL, now + 1) == []  # c's warm-up is in flight
    tracker.record("p", PREFIX, {"a", "c"}, now + 2)  # c now holds it
    busy_c = [view("a", queued=10), view("b"), view("c", queued=10)]
    assert [w.target for w in tracker.plan(busy_c, MODEL, now + 2)] == ["b"]


def test_unconfirmed_warmup_times_out_and_frees_its_slot() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(warmup_timeout_s=5, half_life_s=60))
    now = feed(tracker, "p", rate=5, seconds=20, holders={"a"})
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now)] == ["b"]
    assert tracker.plan(BUSY_HOLDER, MODEL, now + 4) == []
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now + 6)] == ["b"]
    assert tracker.counts[("failed", "timeout")] == 1
    tracker.warmup_finished("p", "b", ok=False)
    assert tracker.counts[("failed", "reported")] == 1
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now + 7)] == ["b"]


def test_per_prefix_replica_cap() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(max_replicas_per_prefix=2))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a", "c"})
    fleet = [view("a", queued=10), view("b"), view("c", queued=10)]
    assert tracker.plan(fleet, MODEL, now) == []
    assert tracker.counts[("skipped", "cap")] == 1


def test_a_draining_holder_does_not_count_toward_the_cap() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(max_replicas_per_prefix=2))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a", "c"})
    fleet = [view("a", queued=10), view("b"), view("c", healthy=False)]  # c: draining, still holds the prefix
    assert [w.target for w in tracker.plan(fleet, MODEL, now)] == ["b"]


def test_global_budget_limits_warmups_and_refills() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(warmup_budget_tokens_per_s=10_000))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    feed(tracker, "q", rate=2, seconds=20, holders={"a"}, start=0.1)
    now += 0.1
    fleet = [view("a", queued=20), view("b"), view("c")]
    first = tracker.plan(fleet, MODEL, now)
    assert len(first) == 1  # 8,000 of 10,000 tokens spent, the other prefix waits
    assert tracker.counts[("skipped", "budget")] == 1
    assert tracker.plan(fleet, MODEL, now + 0.5) == []  # 7,000 available
    assert tracker.counts[("skipped", "budget")] == 2
    second = tracker.plan(fleet, MODEL, now + 0.7)  # 9,000 available
    assert len(second) == 1 and second[0].prefix_key != first[0].prefix_key


def test_retires_warmed_replicas_when_the_prefix_cools() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(half_life_s=10))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    (warmup,) = tracker.plan(BUSY_HOLDER, MODEL, now)
    tracker.record("p", PREFIX, {"a", "b"}, now + 1)
    assert tracker.retire(MODEL, now + 2) == []  # still hot
    (retired,) = tracker.retire(MODEL, now + 30)  # three half-lives later: ~60 ms/s < 100
    assert (retired.prefix_key, retired.replicas, retired.reason) == ("p", frozenset({"b"}), "cooled")
    assert tracker.counts[("retired", "cooled")] == 1
    assert tracker.retire(MODEL, now + 31) == []
    tracker.retire(MODEL, now + 200)  # long forgotten
    assert len(tracker) == 0


def test_disabled_replication_plans_nothing() -> None:
    tracker = HotPrefixTracker(ReplicationConfig(enabled=False))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    assert tracker.plan(BUSY_HOLDER, MODEL, now) == []
    assert len(tracker) == 1  # still tracked: the rates price what evictions cost (cache_margins)


def test_warmed_replica_evicted_while_hot_can_be_warmed_again() -> None:
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now)] == ["b"]
    tracker.record("p", PREFIX, {"a", "b"}, now + 1)  # confirmed
    tracker.record("p", PREFIX, {"a"}, now + 2)  # engine LRU dropped it again
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now + 2)] == ["b"]


def test_a_peers_warmup_holds_the_prefix_until_its_target_holds_it_or_it_times_out() -> None:
    """Each gateway plans from its own traffic: without a peer's word, three gateways warm one prefix three times."""
    tracker = HotPrefixTracker(ReplicationConfig(warmup_timeout_s=5, half_life_s=60))
    assert not tracker.peer_warmup("p", "b", 0.0)  # a prefix this gateway does not track
    now = feed(tracker, "p", rate=5, seconds=20, holders={"a"})
    assert tracker.peer_warmup("p", "b", now)
    assert tracker.plan(BUSY_HOLDER, MODEL, now + 1) == []
    tracker.warmup_finished("p", "b", ok=False)  # not this gateway's warm-up: its report changes nothing
    assert tracker.plan(BUSY_HOLDER, MODEL, now + 2) == []
    assert [w.target for w in tracker.plan(BUSY_HOLDER, MODEL, now + 6)] == ["b"]  # the peer's timed out
    assert tracker.counts[("failed", "timeout")] == 0 and tracker.counts[("failed", "reported")] == 0
    assert not tracker.peer_warmup("p", "c", now + 6)  # this gateway's own warm-up is in flight
    tracker.record("p", PREFIX, {"a", "b"}, now + 7)
    assert tracker.peer_warmup("p", "c", now + 7)
    tracker.record("p", PREFIX, {"a", "b", "c"}, now + 8)  # the peer's target holds it: planning resumes
    assert [w.target for w in tracker.plan([view("a", 10), view("b", 10), view("c", 10), view("d")], MODEL, now + 8)] \
        == ["d"]


def test_one_round_does_not_hand_one_idle_replica_every_hot_prefix() -> None:
    tracker = HotPrefixTracker(ReplicationConfig())
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    feed(tracker, "q", rate=2, seconds=20, holders={"a"}, start=0.1)
    fleet = [view("a", queued=20), view("b"), view("c", queued=1)]
    # b takes the first prefix's 300 ms prefill; c's one queued request (55 ms) is then the shorter wait.
    assert sorted(w.target for w in tracker.plan(fleet, MODEL, now + 0.1)) == ["b", "c"]


@pytest.mark.parametrize("gateways, planned", [(1, 1), (3, 0)])
def test_gateways_share_the_fleets_warmup_budget(gateways: int, planned: int) -> None:
    tracker = HotPrefixTracker(ReplicationConfig(warmup_budget_tokens_per_s=20_000))
    now = feed(tracker, "p", rate=2, seconds=20, holders={"a"})
    assert len(tracker.plan(BUSY_HOLDER, MODEL, now, gateways=gateways)) == planned  # a third: 6,667 < 8,000
