"""The numbers behind a decision, per replica, whatever policy made it (for ``/kvgate/v1/explain`` and logs)."""

from __future__ import annotations

from typing import Sequence

from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.capacity import copy_eviction_ms, free_tokens
from kvgate.policies.cost_model import CostModel, Estimate
from kvgate.policies.load import eligible, expected_arrival_rates, replica_load


def replica_numbers(
    view: ReplicaView, estimate: Estimate, arrival_rate_per_s: float, cost_model: CostModel, least_new_tokens: int
) -> dict[str, object]:
    """One replica's row: the cost model's estimate plus its health (routable, draining, can be a transfer's
    source), load, arrival rate (its own, and the expected one, :func:`policies.load.expected_arrival_rates`), the delay its prefill would impose on that replica's next arrivals, and the
    prefill the fleet would lose to what a copy there evicts (its new blocks beyond ``least_new_tokens``, the fewest
    any replica must store: :func:`policies.capacity.copy_eviction_ms`; with the free room and the cache's margin
    behind that)."""
    row = estimate.as_dict()
    row["healthy"] = view.healthy
    row["draining"] = view.draining
    row["can_source"] = view.can_source
    row["load"] = replica_load(view)
    row["arrival_rate_per_s"] = view.arrival_rate_per_s
    row["expected_arrival_rate_per_s"] = arrival_rate_per_s
    row["interference_ms"] = cost_model.interference_ms(
        arrival_rate_per_s, estimate.prefill_ms, estimate.queue_delay_ms
    )
    row["eviction_ms"] = copy_eviction_ms(view, estimate.new_tokens, least_new_tokens)
    row["free_tokens"] = free_tokens(view)
    row["cache_margin"] = None if view.cache_margin is None else view.cache_margin.as_dict()
    return row


def explain_replicas(
    request: RouteRequest, replicas: Sequence[ReplicaView], cost_model: CostModel, match_weight: float = 1.0
) -> dict[str, dict[str, object]]:
    """Per replica ``{queue_delay_ms, predicted_ttft_ms, cached_tokens, ...}`` as the cost model sees it.

    The ``cost`` policy puts exactly these rows in ``Decision.details["replicas"]``; for the other policies the
    router calls this so explain shows what the cost model would have predicted for their choice.
    """
    estimates = {v.name: cost_model.estimate(request, v, match_weight) for v in replicas}
    views = eligible(replicas)
    rates = expected_arrival_rates(views, {name: e.cached_tokens for name, e in estimates.items()})
    least = min((estimates[v.name].new_tokens for v in views), default=0)
    return {v.name: replica_numbers(v, estimates[v.name], rates.get(v.name, v.arrival_rate_per_s), cost_model, least)
            for v in replicas}
