"""Prefix affinity: the SGLang Model Gateway's ``cache_aware`` rule, as a baseline to measure against."""

from __future__ import annotations

import random
from typing import ClassVar, Sequence

from kvgate.policies.base import Decision, ReplicaView, RouteRequest
from kvgate.policies.config import PrefixAffinityConfig
from kvgate.policies.load import eligible, least_loaded, rank_by_load, replica_load


class PrefixAffinityPolicy:
    """SGLang's cache_aware decision (``sgl-model-gateway/src/policies/cache_aware.rs``), on token matches.

    1. Load imbalanced — ``max − min > balance_abs_threshold`` and ``max > min × balance_rel_threshold`` over the
       eligible replicas' loads — → the least-loaded replica (reason ``imbalanced``).
    2. Else if ``matched tokens / prompt tokens > cache_threshold`` on the best-matching replica → that replica
       (reason ``affinity``; ties between equal matches go to the less loaded, then at random).
    3. Else → the least-loaded replica (reason ``least-loaded``).

    Parameters (``policy.prefix_affinity``; defaults are SGLang's CLI defaults):
        cache_threshold: 0.3. balance_abs_threshold: 64. balance_rel_threshold: 1.5.
        rng: breaks load ties at random.
    """

    name: ClassVar[str] = "prefix_affinity"

    def __init__(self, config: PrefixAffinityConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        views = eligible(replicas)
        loads = [replica_load(v) for v in views]
        highest, lowest = max(loads), min(loads)
        cfg = self.config
        details: dict[str, object] = {"load_min": lowest, "load_max": highest}
        if highest - lowest > cfg.balance_abs_threshold and highest > lowest * cfg.balance_rel_threshold:
            chosen, reason = least_loaded(views, self._rng), "imbalanced"
        else:
            longest = max(v.match.total for v in views)
            match_rate = longest / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
            details["match_rate"] = round(match_rate, 4)
            if longest > 0 and match_rate > cfg.cache_threshold:
                chosen = least_loaded([v for v in views if v.match.total == longest], self._rng)
                reason = "affinity"
            else:
                chosen, reason = least_loaded(views, self._rng), "least-loaded"
        return Decision(
            replica=chosen.name, reason=reason, ranked=rank_by_load(chosen, views), details=details if explain else {}
        )
