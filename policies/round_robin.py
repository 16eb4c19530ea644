"""Round robin: the baseline that ignores both cache and load."""

from __future__ import annotations

from typing import ClassVar, Sequence

from kvgate.policies.base import Decision, ReplicaView, RouteRequest
from kvgate.policies.load import eligible


class RoundRobinPolicy:
    """Cycles through the eligible replicas in the order given.

    Parameters: none. The cursor advances once per decision; unhealthy replicas are skipped (the cycle runs over
    the healthy ones), so a replica coming back simply rejoins the rotation.
    """

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        views = eligible(replicas)
        start = self._cursor % len(views)
        self._cursor += 1
        order = views[start:] + views[:start]
        return Decision(replica=order[0].name, reason="round-robin", ranked=[v.name for v in order])
