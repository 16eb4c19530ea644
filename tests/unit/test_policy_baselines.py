"""The registry and the baseline policies (round_robin, least_loaded, prefix_affinity) on constructed fleets."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import PolicyConfig, PrefixAffinityConfig, TransferConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.least_loaded import LeastLoadedPolicy
from kvgate.policies.prefix_affinity import PrefixAffinityPolicy
from kvgate.policies.registry import POLICY_NAMES, create_policy
from kvgate.policies.round_robin import RoundRobinPolicy
from kvgate.router.core.config import ModelConfig

REQUEST = RouteRequest(request_id="r", model="m", prompt_tokens=1000, block_size=16)


def default_cost_model() -> CostModel:
    model = ModelConfig(name="m")
    return CostModel.from_config(model.prefill, model.kv_bytes_per_token, PolicyConfig(), TransferConfig())


def replica(name: str, *, healthy: bool = True, gpu: int = 0, in_flight: int = 0, **kw: object) -> ReplicaView:
    return ReplicaView(name=name, healthy=healthy, match=PrefixMatch(gpu=gpu), in_flight=in_flight, **kw)


def test_registry_builds_every_named_policy() -> None:
    config = PolicyConfig()
    for name in POLICY_NAMES:
        policy = create_policy(name, config, default_cost_model(), random.Random(0))
        assert policy.name == name
        assert policy.decide(REQUEST, [replica("a"), replica("b")]).replica in {"a", "b"}


def test_registry_rejects_unknown_name() -> None:
    config = PolicyConfig()
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        create_policy("fastest", config, default_cost_model())


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    policy = RoundRobinPolicy()
    fleet = [replica("a"), replica("b", healthy=False), replica("c")]
    picks = [policy.decide(REQUEST, fleet).replica for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]
    decision = policy.decide(REQUEST, fleet)
    assert decision.ranked == ["a", "c"] and decision.reason == "round-robin"


def test_unhealthy_fleet_still_gets_a_replica() -> None:
    fleet = [replica("a", healthy=False), replica("b", healthy=False)]
    decision = LeastLoadedPolicy(random.Random(0)).decide(REQUEST, fleet)
    assert decision.replica in {"a", "b"} and sorted(decision.ranked) == ["a", "b"]


def test_least_loaded_uses_scraped_queue_and_breaks_ties_randomly() -> None:
    policy = LeastLoadedPolicy(random.Random(1))
    fleet = [
        replica("a", in_flight=1, scraped_waiting=5, scraped_running=2),
        replica("b", in_flight=3),
        replica("c", in_flight=3, scraped_waiting=0, scraped_running=1),
        replica("d", healthy=False),
    ]
    counts = Counter(policy.decide(REQUEST, fleet).replica for _ in range(200))
    assert set(counts) == {"b", "c"} and min(counts.values()) > 50
    decision = policy.decide(REQUEST, fleet)
    assert decision.ranked[-1] == "a" and "d" not in decision.ranked


@pytest.mark.parametrize(
    "a_gpu, b_gpu, expected",
    [(400, 100, ("a", "affinity")), (300, 0, ("b", "least-loaded"))],
    ids=["match-above-threshold-follows-it", "low-match-goes-least-loaded"],
)
def test_prefix_affinity_follows_a_match_only_above_its_threshold(
    a_gpu: int, b_gpu: int, expected: tuple[str, str]
) -> None:
    policy = PrefixAffinityPolicy(PrefixAffinityConfig(), random.Random(0))
    fleet = [replica("a", gpu=a_gpu, in_flight=10), replica("b", gpu=b_gpu)]
    decision = policy.decide(REQUEST, fleet)
    assert (decision.replica, decision.reason) == expected


def test_prefix_affinity_switches_to_least_loaded_when_imbalanced() -> None:
    policy = PrefixAffinityPolicy(PrefixAffinityConfig(), random.Random(0))
    # max - min must exceed 64 AND max must exceed 1.5 x min.
    balanced_abs = [replica("a", gpu=900, in_flight=64), replica("b", in_flight=0)]
    assert policy.decide(REQUEST, balanced_abs).reason == "affinity"
    balanced_rel = [replica("a", gpu=900, in_flight=200), replica("b", in_flight=134)]
    assert policy.decide(REQUEST, balanced_rel).reason == "affinity"
    imbalanced = [replica("a", gpu=900, in_flight=65), replica("b", in_flight=0)]
    decision = policy.decide(REQUEST, imbalanced)
    assert (decision.replica, decision.reason) == ("b", "imbalanced")


STABLE_REASONS = {"round-robin", "least-loaded", "affinity", "imbalanced", "warm", "idle-recompute", "cold", "session", "transfer"}


def test_every_policy_on_random_fleets_keeps_the_contract() -> None:
    """Healthy replicas only (while any), ranked = every eligible replica once, chosen first, a known reason."""
    rng = random.Random(42)
    config = PolicyConfig()
    for name in POLICY_NAMES:
        policy = create_policy(name, config, default_cost_model(), random.Random(0))
        for _ in range(300):
            fleet = [
                ReplicaView(
                    name=f"r{i}",
                    healthy=rng.random() < 0.6,
                    match=PrefixMatch(gpu=rng.choice([0, 500, 3000]), cpu=rng.choice([0, 200]), predicted=rng.choice([0, 16])),
                    in_flight=rng.randint(0, 100),
                    in_flight_prefilling=rng.randint(0, 3),
                    in_flight_prefill_tokens=rng.randint(0, 5000),
                    scraped_waiting=rng.choice([None, 0, 7]),
                    scraped_running=rng.choice([None, 3, 90]),
                    last_session_match=rng.random() < 0.2,
                )
                for i in range(rng.randint(1, 8))
            ]
            req = RouteRequest(request_id="r", model="m", prompt_tokens=rng.randint(0, 6000), block_size=16,
                               approximate=rng.random() < 0.2)
            decision = policy.decide(req, fleet)
            healthy = {v.name for v in fleet if v.healthy}
            eligible_names = healthy or {v.name for v in fleet}
            assert decision.replica in eligible_names, name
            assert decision.ranked[0] == decision.replica
            assert sorted(decision.ranked) == sorted(eligible_names)
            assert decision.reason in STABLE_REASONS
