"""The queue stage, between tokenize and route: the request passes the admission gate
(:mod:`kvgate.router.admission`), waiting there while the fleet is saturated, so that it is routed on the fleet as
it is when it may start. Its priority is the body's ``priority``, else the ``X-Vllm-Priority`` header, else its
tenant's class; a tenant may ask for a later band than its class's but never an earlier one, so no caller can jump
ahead of the operator's order. With ``admission.forward_priority`` the engine gets that priority in the body."""

from __future__ import annotations

import msgspec

from kvgate.router.admission.gate import AdmissionGate, Ticket
from kvgate.router.core.http import HttpRequest
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.disconnect import while_connected
from kvgate.router.pipeline.bodies import priority_of
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.routing.records import Prompt

_encode = msgspec.json.Encoder().encode


class QueueStage:
    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate

    def band_of(self, parsed: Parsed, admission: Admission) -> int:
        """The band the request waits in (:class:`ApiError` 400 for a priority that is not an integer)."""
        config = self.gate.config
        asked = parsed.priority
        if asked is None:
            asked = priority_of(admission.client.priority, "x-vllm-priority")
        floor = config.class_of(admission.tenant).priority
        return floor if asked is None else max(asked, floor)

    async def wait(self, request: HttpRequest, prompt: Prompt, parsed: Parsed, admission: Admission) -> Ticket | None:
        """The request's ticket once it may be routed, or None when its client left while it waited; the prompt's
        candidates lose the replicas it must leave to other tenants (the headroom). Raises :class:`ApiError` (400 a
        bad priority, 429 over a limit, 503 queue full or deadline)."""
        band = self.band_of(parsed, admission)
        config = self.gate.config
        if config.forward_priority:
            with_priority(parsed, band)
        entered = self.gate.enter(prompt.base_model, prompt.candidates, prompt.routing, admission.tenant, band,
                                  prompt.tokenized.token_count, len(parsed.raw))
        if isinstance(entered, Ticket):
            ticket: Ticket | None = entered
        else:
            if admission.trace is not None:
                admission.trace.stage("queue", {"kvgate.queue.band": band})
            ticket = await while_connected(request, entered.wait())
        if ticket is not None and ticket.avoid:
            prompt.candidates = [name for name in prompt.candidates if name not in ticket.avoid]
        return ticket

    def explain(self, prompt: Prompt, parsed: Parsed, admission: Admission) -> dict[str, object]:
        return self.gate.explain(prompt.base_model, prompt.candidates, prompt.routing,
                                 self.band_of(parsed, admission))


def with_priority(parsed: Parsed, band: int) -> None:
    """The body the engine gets names ``band`` as its priority (re-encoded only when that changes it)."""
    if parsed.body.get("priority", 0) != band:
        parsed.body["priority"] = band
        parsed.raw = _encode(parsed.body)
