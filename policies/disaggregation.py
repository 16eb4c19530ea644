"""Prefill/decode disaggregation's choices that do not price anything: which replica decodes a disaggregated
request, and which replicas may prefill it. The pricing is the cost model's (:meth:`CostModel.handoff_estimate`,
:meth:`CostModel.decode_stall_ms`) and the comparison the ``cost`` policy's (:mod:`policies.cost`)."""

from __future__ import annotations

from typing import Sequence

from kvgate.policies.base import ReplicaView
from kvgate.policies.load import replica_load


def has_prefill_replicas(replicas: Sequence[ReplicaView]) -> bool:
    """Whether the fleet disaggregates at all: a fleet without a prefill replica pays nothing for it."""
    return any(v.role == "prefill" for v in replicas)


def decode_target(views: Sequence[ReplicaView]) -> ReplicaView | None:
    """The replica that decodes a disaggregated request: among the routable ones that take requests (``views``, from
    :func:`policies.load.eligible`), the ``decode``-role replicas, or the ``both`` ones when there is none; the least
    loaded, then the one with the most KV room (scraped cache usage). Never by prefix: the KV comes from the prefill
    replica, and a decode replica that holds the prompt is the local alternative's, priced on its own."""
    routable = [v for v in views if v.healthy]
    decode = [v for v in routable if v.role == "decode"] or [v for v in routable if v.role == "both"]
    if not decode:
        return None
    return min(decode, key=lambda v: (replica_load(v), v.kv_usage or 0.0))


def prefill_candidates(replicas: Sequence[ReplicaView], decode: ReplicaView) -> list[ReplicaView]:
    """The prefill replicas that may run ``decode``'s request's prefill leg: routable, and of its engine kind (one
    handoff protocol per request)."""
    return [v for v in replicas if v.role == "prefill" and v.healthy and v.engine == decode.engine]
