"""Policies by name: the one place the policy file's ``policy.name`` (or ``--policy``) becomes a policy object."""

from __future__ import annotations

import random

from kvgate.policies.base import Policy
from kvgate.policies.config import DisaggregationConfig, PolicyConfig
from kvgate.policies.cost import CostPolicy
from kvgate.policies.cost_model import CostModel
from kvgate.policies.least_loaded import LeastLoadedPolicy
from kvgate.policies.prefix_affinity import PrefixAffinityPolicy
from kvgate.policies.round_robin import RoundRobinPolicy

POLICY_NAMES: tuple[str, ...] = (
    CostPolicy.name,
    PrefixAffinityPolicy.name,
    LeastLoadedPolicy.name,
    RoundRobinPolicy.name,
)


def create_policy(
    name: str, config: PolicyConfig, cost_model: CostModel, rng: random.Random | None = None,
    disaggregation: DisaggregationConfig = DisaggregationConfig(),
) -> Policy:
    """A fresh policy named ``name``, configured from its own part of the ``policy`` section (the ``cost`` policy
    also from ``disaggregation``: the other policies never disaggregate).

    ``rng`` drives tie-breaks; by default each policy gets its own unseeded generator so that separate router
    processes break ties differently. Raises ValueError for an unknown name.
    """
    rng = rng if rng is not None else random.Random()
    if name == CostPolicy.name:
        return CostPolicy(config.cost, cost_model, rng, disaggregation)
    if name == PrefixAffinityPolicy.name:
        return PrefixAffinityPolicy(config.prefix_affinity, rng)
    if name == LeastLoadedPolicy.name:
        return LeastLoadedPolicy(rng)
    if name == RoundRobinPolicy.name:
        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
