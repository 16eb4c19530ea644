"""The forward stage: the request sent to the chosen replica (retried on the ranked ones before any byte reached the
client, each attempt within the deadline the route stage planned for it), or through its engine kind's handoff when
the decision moves KV (a transfer, a disaggregated request), and all of it cancelled when the client leaves.

A routed request leaves its prediction behind as it is sent (:mod:`kvgate.router.routing.predictions`) and counts
toward its prefix's heat (:mod:`kvgate.router.routing.replication`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvgate.router.core.http import HttpRequest
from kvgate.router.fleet.attempts import Attempts, Load, Upstream
from kvgate.router.fleet.state import Fleet
from kvgate.router.pipeline.disconnect import while_connected
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.routing.handoff.base import HandoffRequest, Handoffs
from kvgate.router.routing.predictions import Predictions
from kvgate.router.routing.records import Routed
from kvgate.router.routing.replication import Replication
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.proxy import Forward

if TYPE_CHECKING:
    from kvgate.router.pipeline.spans import RequestTrace


class Forwarder:
    def __init__(self, attempts: Attempts, fleet: Fleet, predictions: Predictions, replication: Replication,
                 handoffs: Handoffs, config: ProxyConfig) -> None:
        self.attempts = attempts
        self.fleet = fleet
        self.predictions = predictions
        self.replication = replication
        self.handoffs = handoffs
        self.config = config

    def reconfigure(self, config: ProxyConfig) -> None:
        self.config = config

    async def send(
        self, request: HttpRequest, path: str, parsed: Parsed, routed: Routed, headers: dict[str, str],
        method: str = "POST", trace: RequestTrace | None = None,
    ) -> Upstream | None:
        """The upstream answer (its first byte in), or None when the client left first. Raises
        :class:`~kvgate.router.upstream.proxy.AttemptFailed` when every attempt failed. A traced request's every
        engine request, a handoff's legs included, is an attempt in its ``trace``."""
        if trace is not None:
            trace.forwarding(routed)
        decision = routed.decision
        tenant = routed.request.tenant
        api = parsed.api
        holds_output = api.holds_output if api is not None else None
        predicts = routed.routing is not None and routed.whole and routed.prefills
        max_attempts = self.config.max_attempts

        async def send(raw: bytes, replicas: Sequence[str]) -> Upstream:
            # What the dispatch leaves behind is recorded once the request is written, while the engine works,
            # before this task yields: the next request routed already sees it.
            on_sent = functools.partial(self.dispatched, routed, replicas[0]) if predicts else None
            fwd = Forward(path, raw, headers, parsed.stream, replicas, max_attempts, routed.deadlines_s, holds_output,
                          method, trace, on_sent)
            load = Load({name: routed.prefill_tokens(name) for name in replicas[:max_attempts]}, tenant)
            up = await self.attempts.forward(fwd, load)
            if predicts and up.replica != replicas[0]:
                self.dispatched(routed, up.replica)
            return up

        handoff = self.handoffs.of(self._engine(decision.replica)) if decision.source is not None else None
        if handoff is None or api is None:
            return await while_connected(request, send(parsed.raw, decision.ranked or [decision.replica]))
        # The source computes the prompt from now on: its blocks are predicted at once. The destination's are
        # predicted when its leg is sent (``send``), once the KV it pulls exists: before, a sibling request would be
        # priced as a hit there and recompute the prompt.
        assert decision.source is not None
        self.predictions.predict(routed, decision.source)
        handoff_request = HandoffRequest(api, parsed.body, parsed.raw, headers, routed, trace)
        return await while_connected(request, handoff.run(handoff_request, send))

    def _engine(self, name: str) -> str:
        replica = self.fleet.replicas.get(name)
        return "vllm" if replica is None else replica.config.engine

    def dispatched(self, routed: Routed, replica: str) -> None:
        """Sent to ``replica``: its blocks predicted there, the session remembered, the prefix's heat counted. A
        request routed on its prompt's beginning has that beginning's blocks predicted now, and the rest once the
        whole prompt is tokenized."""
        completed = routed.completed
        if completed is not None and not completed.done():
            self.predictions.predict(routed, replica)
            completed.add_done_callback(lambda _: self.dispatched(routed, replica))
            return
        if self.predictions.dispatched(routed, replica):
            self.replication.record(routed)
