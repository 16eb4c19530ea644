"""The numbers behind a decision, per replica, whatever policy made it (for ``/kvgate/v1/explain`` and logs)."""

from __future__ import annotations

from typing import Sequence

from policies.base import ReplicaView, RouteRequest
from policies.cost_model import CostModel, Estimate
from policies.load import replica_load


def replica_numbers(view: ReplicaView, estimate: Estimate) -> dict[str, object]:
    """One replica's row: the cost model's estimate plus its health (routable, draining, can be a transfer's
    source), load, arrival rate, and the delay its prefill would impose on that replica's next arrivals."""
    row = estimate.as_dict()
    row["healthy"] = view.healthy
    row["draining"] = view.draining
    row["can_source"] = view.can_source
    row["load"] = replica_load(view)
    row["arrival_rate_per_s"] = view.arrival_rate_per_s
    row["interference_ms"] = CostModel.interference_ms(view, estimate.prefill_ms)
    return row


def explain_replicas(
    request: RouteRequest, replicas: Sequence[ReplicaView], cost_model: CostModel, match_weight: float = 1.0
) -> dict[str, dict[str, object]]:
    """Per replica ``{queue_delay_ms, predicted_ttft_ms, cached_tokens, ...}`` as the cost model sees it.

    The ``cost`` policy puts exactly these rows in ``Decision.details["replicas"]``; for the other policies the
    router calls this so explain shows what the cost model would have predicted for their choice.
    """
    return {v.name: replica_numbers(v, cost_model.estimate(request, v, match_weight)) for v in replicas}
