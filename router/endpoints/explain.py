"""``POST /kvgate/v1/explain``: a body of any routed API (``?api=``) routed without being sent (admit → parse → tokenize
→ route), answered with the decision and the numbers behind it, per replica (:func:`explain_body`); a tenant sees only
the part of it that is its own (:func:`tenant_view`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


from kvgate.policies.explain import explain_replicas
from kvgate.router.apis.anthropic import MESSAGES
from kvgate.router.apis.base import Api
from kvgate.router.apis.openai import CHAT, COMPLETIONS
from kvgate.router.apis.responses import RESPONSES
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest
from kvgate.router.endpoints.callers import Callers
from kvgate.router.pipeline.admit import Admission, check_client_ids, read_within_limits
from kvgate.router.pipeline.bodies import priority_of
from kvgate.router.pipeline.parse import parse, salt_for_tenant
from kvgate.router.pipeline.queue import QueueStage
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.routing.records import Routed
from kvgate.router.settings.holder import ConfigHolder


class Explain:
    def __init__(
        self, holder: ConfigHolder, callers: Callers, catalog: ModelCatalog, tokenize: TokenizeStage,
        route: RouteStage, generation_of: Callable[[str], int | None], parity: ParityMonitor, queue: QueueStage,
    ) -> None:
        self.holder = holder
        self.callers = callers
        self.catalog = catalog
        self.tokenize = tokenize
        self.route = route
        self.generation_of = generation_of
        """The index's generation of a replica (None when the index does not track it)."""
        self.parity = parity
        self.queue = queue

    async def __call__(self, request: HttpRequest) -> dict[str, Any]:
        admission = Admission.of(request)
        admission.tenant, full = self.callers.explain_caller(admission.client, request.header("x-kvgate-tenant"))
        config = self.holder.current
        check_client_ids(admission.client, config.limits)
        raw = await read_within_limits(request, config.server, config.limits)
        may_use = (lambda model: True) if full else self.callers.may_use(admission.tenant)
        parsed = parse(raw, None, self.catalog, may_use)
        parsed.api = api_of(request.query_param("api"), parsed.body)
        parsed.max_tokens = parsed.api.max_tokens(parsed.body)
        parsed.priority = priority_of(parsed.body.get("priority"), "priority")
        parsed = salt_for_tenant(parsed, self.callers.tenants, admission.tenant)
        prompt = await self.tokenize.tokenize(parsed)
        routed = self.route.route(prompt, admission, parsed.stream, explain=True)
        explained = explain_body(routed, config.policy.name, self.generation_of)
        explained["parity"] = self.parity.state().get(prompt.base_model, {"trusted": True})
        explained["admission"] = self.queue.explain(prompt, parsed, admission)
        return explained if full else tenant_view(explained)


EXPLAINED_APIS: dict[str, Api] = {api.name: api for api in (CHAT, COMPLETIONS, MESSAGES, RESPONSES)}


def api_of(name: str | None, body: dict[str, Any]) -> Api:
    """The API a body to explain speaks: ``?api=`` (chat, completions, messages, responses), else its shape (``input``:
    Responses; ``messages``: chat completions; else completions)."""
    if name is not None:
        api = EXPLAINED_APIS.get(name)
        if api is None:
            raise ApiError(400, f"api must be one of {', '.join(EXPLAINED_APIS)}", param="api", code="invalid_value")
        return api
    return RESPONSES if "input" in body else CHAT if "messages" in body else COMPLETIONS


def explain_body(routed: Routed, policy: str, generation_of: Callable[[str], int | None]) -> dict[str, Any]:
    """``routed``'s decision and numbers under ``policy``; ``generation_of`` is the index's generation of a replica
    (None when the index does not track it)."""
    decision = routed.decision
    request = routed.request
    assert routed.routing is not None and routed.tokenized is not None
    numbers = decision.details.get("replicas")
    if not isinstance(numbers, dict):
        numbers = explain_replicas(request, list(routed.views.values()), routed.routing.cost_model)
    replicas = []
    for name, view in routed.views.items():
        row = dict(numbers.get(name, {}))
        row.pop("cached_tokens", None)
        # The index's generation moves on every restart, AllBlocksCleared and reset (health recovery included);
        # the fleet's counts health recoveries only.
        generation = generation_of(name)
        replicas.append({
            "name": name,
            "role": view.role,
            "block_size": routed.block_sizes.get(name, request.block_size),
            "healthy": view.healthy,
            "draining": view.draining,
            "can_source": view.can_source,
            "generation": view.generation if generation is None else generation,
            "cached_tokens": view.match.as_dict(),
            "queue_delay_ms": row.pop("queue_delay_ms", 0.0),
            "predicted_ttft_ms": row.pop("predicted_ttft_ms", 0.0),
            "in_flight": view.in_flight,
            "in_flight_prefill_tokens": view.in_flight_prefill_tokens,
            **row,
        })
    prefill = routed.routing.cost_model.prefill
    calibrator = routed.routing.calibrator
    extra = {k: v for k, v in decision.details.items() if k != "replicas"}
    return {
        "prompt_tokens": request.prompt_tokens,
        "approximate": request.approximate,
        "new_session": request.new_session,
        "tokenizer": routed.tokenized.source,
        "block_size": request.block_size,
        "blocks": len(routed.keys),
        "policy": policy,
        "decision": {
            "replica": decision.replica,
            "action": decision.action,
            "reason": decision.reason,
            "source": decision.source,
            "ranked": decision.ranked,
            **extra,
        },
        "replicas": replicas,
        "cost_model": {
            "fixed_ms": prefill.fixed_ms,
            "per_token_ms": prefill.per_token_ms,
            "quadratic_ms": prefill.quadratic_ms,
            "decode_ms_per_token": prefill.decode_ms_per_token,
            "queue_scale": prefill.queue_scale,
            "calibration": None if calibrator is None else dataclasses.asdict(calibrator.state()),
        },
        "route_ms": round(routed.route_ms, 3),
    }


TENANT_REPLICA_FIELDS = ("name", "role", "block_size", "healthy", "draining", "can_source", "generation",
                         "cached_tokens")
"""What a tenant sees of each replica: its state and what the tenant's own namespace holds there. Every load figure
(queues, requests and tokens in flight, free cache room, arrival rates, predicted TTFT) moves with other tenants'
traffic: a tenant polling them learned another's prompt sizes and hit pattern."""
TENANT_DECISION_FIELDS = ("replica", "action", "reason", "source", "ranked")
ADMIN_ONLY = ("decision", "replicas", "cost_model", "route_ms", "parity", "admission")
"""Top-level parts a tenant gets only in part (decision, replicas, parity) or not at all."""


def tenant_view(explained: dict[str, Any]) -> dict[str, Any]:
    """``explained`` as a tenant (not the admin) may see it: the decision and its own cached tokens per replica, no
    figure that moves with another tenant's traffic (load, calibration, ``route_ms``, saturation and the queue)."""
    decision = explained["decision"]
    return {
        **{k: v for k, v in explained.items() if k not in ADMIN_ONLY},
        "parity": {"trusted": explained["parity"]["trusted"]},
        "decision": {k: decision[k] for k in TENANT_DECISION_FIELDS},
        "replicas": [{k: row[k] for k in TENANT_REPLICA_FIELDS} for row in explained["replicas"]],
    }
