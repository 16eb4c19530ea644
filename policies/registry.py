"""Policies by name: the one place the policy file's ``policy.name`` (or ``--policy``) becomes a policy object."""

from __future__ import annotations

import random

from policies.base import Policy
from policies.config import KvgateConfig
from policies.cost import CostPolicy
from policies.cost_model import CostModel
from policies.least_loaded import LeastLoadedPolicy
from policies.prefix_affinity import PrefixAffinityPolicy
from policies.round_robin import RoundRobinPolicy

POLICY_NAMES: tuple[str, ...] = (
    CostPolicy.name,
    PrefixAffinityPolicy.name,
    LeastLoadedPolicy.name,
    RoundRobinPolicy.name,
)


def create_policy(
    name: str, config: KvgateConfig, cost_model: CostModel, rng: random.Random | None = None
) -> Policy:
    """A fresh policy named ``name`` configured from ``config``.

    ``rng`` drives tie-breaks; by default each policy gets its own unseeded generator so that separate router
    processes break ties differently. Raises ValueError for an unknown name.
    """
    rng = rng if rng is not None else random.Random()
    if name == CostPolicy.name:
        return CostPolicy(config.policy.cost, cost_model, rng)
    if name == PrefixAffinityPolicy.name:
        return PrefixAffinityPolicy(config.policy.prefix_affinity, rng)
    if name == LeastLoadedPolicy.name:
        return LeastLoadedPolicy(rng)
    if name == RoundRobinPolicy.name:
        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
