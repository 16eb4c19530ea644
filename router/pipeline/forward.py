"""The forward stage: the request sent to the chosen replica (retried on the ranked ones before any byte reached the
client, each attempt with its first-byte deadline) — through its engine kind's handoff when the decision moves KV
(a transfer, a disaggregated request) —, cancelled when the client leaves, and the answer relayed (streamed as it
comes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from kvgate.router.fleet.state import Fleet
from kvgate.router.http.errors import as_json_error
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.routing.handoff import HandoffRequest, Handoffs
from kvgate.router.routing.replication import Replication
from kvgate.router.routing.router import FleetDispatcher, Routed, Router
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.proxy import (
    Forward,
    Proxy,
    RelayResponse,
    StreamResult,
    Upstream,
    cancel_on_disconnect,
    first_byte_deadline_s,
    left_early,
    relay_stream,
)

Finished = Callable[[Upstream, StreamResult | None], None]
"""Called once the answer is complete: with the stream's result, or None for an answer read whole."""


class Forwarder:
    def __init__(self, proxy: Proxy, fleet: Fleet, router: Router, replication: Replication,
                 handoffs: Handoffs) -> None:
        self.proxy = proxy
        self.fleet = fleet
        self.router = router
        self.replication = replication
        self.handoffs = handoffs

    async def send(
        self, request: Request, path: str, parsed: Parsed, routed: Routed, headers: dict[str, str],
        config: ProxyConfig,
    ) -> Upstream | None:
        """The upstream answer (its first byte in), or None when the client left first. Raises
        :class:`~kvgate.router.upstream.proxy.AttemptFailed` when every attempt failed."""
        decision = routed.decision
        dispatcher = FleetDispatcher(self.fleet, routed.prefill_tokens, routed.request.tenant)
        stream, max_tokens = parsed.stream, routed.request.max_tokens

        def deadline_s(replica: str) -> float:
            return first_byte_deadline_s(config, routed.predicted_ttft_ms(replica), stream, max_tokens)

        async def send(raw: bytes, replicas: Sequence[str]) -> Upstream:
            self.dispatched(routed, replicas[0])
            fwd = Forward(path, raw, headers, stream, replicas, config.max_attempts, deadline_s)
            up = await self.proxy.forward(fwd, dispatcher)
            if up.replica != replicas[0]:
                self.dispatched(routed, up.replica)
            return up

        handoff = self.handoffs.of(self._engine(decision.replica)) if decision.source is not None else None
        if handoff is None:
            return await self.while_connected(request, send(parsed.raw, decision.ranked or [decision.replica]))
        # The source computes the prompt from now on: its blocks are predicted at once. The destination's are
        # predicted when its leg is sent (``send``), once the KV it pulls exists: before, a sibling request would be
        # priced as a hit there and recompute the prompt.
        assert decision.source is not None
        self.router.predict(routed, decision.source)
        handoff_request = HandoffRequest(path, parsed.body, parsed.raw, headers, routed, dispatcher)
        return await self.while_connected(request, handoff.run(handoff_request, send))

    def _engine(self, name: str) -> str:
        replica = self.fleet.replicas.get(name)
        return "vllm" if replica is None else replica.config.engine

    def dispatched(self, routed: Routed, replica: str) -> None:
        """Sent to ``replica``: its blocks predicted there, the session remembered, the prefix's heat counted."""
        if self.router.dispatched(routed, replica):
            self.replication.record(routed)

    @staticmethod
    async def while_connected(request: Request, forward: Awaitable[Upstream | None]) -> Upstream | None:
        """``forward`` (the request's upstream legs), cancelled the moment the client disconnects (None then): closing
        the upstream connection makes the engine abort the sequence, even during a long prefill before any byte
        came back — a handoff's prefill leg included, whose KV would otherwise stay held for a decode leg that
        never comes.

        The forward runs in the request's own task and only the watcher is a second one, which cancels this task
        when the client leaves: a task for the forward plus ``asyncio.wait`` cost more CPU per request."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(cancel_on_disconnect(request.receive, task))
        try:
            return await forward
        except asyncio.CancelledError:
            if left_early(watcher):
                task.uncancel()
                return None
            raise
        finally:
            watcher.cancel()


def relay(up: Upstream, routed: Routed, request_id: str, stream: bool, finished: Finished) -> Response:
    """The client's response: the engine's answer with kvgate's headers, streamed when it is a stream; ``finished``
    runs when it is complete (a stream's end, or at once)."""
    headers = up.client_headers()
    headers.update({
        "x-request-id": request_id, "x-kvgate-replica": up.replica, "x-kvgate-decision": routed.decision.reason,
    })
    if stream and up.status == 200:
        def on_end(result: StreamResult) -> None:
            up.ticket.finish(result.end != "stream_error")
            finished(up, result)

        return RelayResponse(relay_stream(up, on_end), status_code=up.status, headers=headers)
    up.settle()
    finished(up, None)
    if up.status >= 400:
        body, headers["content-type"] = as_json_error(up.status, up.body, headers.get("content-type"))
        return Response(body, status_code=up.status, headers=headers)
    return Response(up.body, status_code=up.status, headers=headers)
