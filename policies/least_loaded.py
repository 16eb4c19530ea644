"""Least loaded: the baseline that follows live queue depth and ignores the cache."""

from __future__ import annotations

import random
from typing import ClassVar, Sequence

from kvgate.policies.base import Decision, ReplicaView, RouteRequest
from kvgate.policies.load import eligible, least_loaded, rank_by_load, replica_load


class LeastLoadedPolicy:
    """Picks the eligible replica with the fewest queued + running requests (:func:`policies.load.replica_load`).

    Parameters:
        rng: breaks ties between equally loaded replicas at random (seed it for reproducible tests).
    """

    name: ClassVar[str] = "least_loaded"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        views = eligible(replicas)
        chosen = least_loaded(views, self._rng)
        return Decision(
            replica=chosen.name,
            reason="least-loaded",
            ranked=rank_by_load(chosen, views),
            details={"load": {v.name: replica_load(v) for v in views}} if explain else {},
        )
