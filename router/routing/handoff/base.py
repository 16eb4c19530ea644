"""Handoffs: a request prefilled on one replica and decoded on another, by the protocol of the replicas' engine kind.

A ``transfer`` decision (a warm prefix pulled from a replica that holds it) and a ``disaggregate`` one (the prompt
prefilled on a prefill replica) both hand KV from ``decision.source`` to ``decision.replica``; how depends on the
engines. vLLM (:mod:`.vllm`, NixlConnector) runs two legs in sequence: a prefill-only request on the source, then
the client's request on the destination carrying the ``kv_transfer_params`` it returned. Each protocol is one
:class:`Handoff`, chosen by :class:`Handoffs` from the destination's engine kind.

What every handoff guarantees the client: one answer, the destination's (streamed as asked), under the client's
request id; the handshake is never seen. A prefill leg that fails or times out falls back to a local prefill on the
destination; a destination that fails before its first byte is retried on the next ranked replica as a local
prefill (see docs/disaggregation.md for why not with the same KV).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.router.apis.base import Api
from kvgate.router.core.trace_context import AttemptTracing
from kvgate.router.fleet.attempts import Load, Upstream
from kvgate.router.routing.records import Routed

Send = Callable[[bytes, Sequence[str]], Awaitable[Upstream]]
"""Sends the client's request (these bytes) to the first of these replicas that answers, each attempt within its
first-byte deadline: the answer (first byte in), or :class:`~kvgate.router.upstream.proxy.AttemptFailed` when every
attempt failed. The forward stage's, so a handoff's decode leg is forwarded exactly as any request is. The forward
stage runs the whole handoff cancelled the moment the client leaves (every leg, the prefill leg included)."""


@dataclass(slots=True)
class HandoffRequest:
    """A decided handoff: the client's request as parsed, and where it goes (``routed.decision``: ``source`` and
    ``replica``, ``ranked`` for retries)."""

    api: Api
    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]
    """The headers every leg carries (the client's ``X-Request-Id`` among them)."""
    routed: Routed
    trace: AttemptTracing | None = None
    """The traced request: each leg's engine request is an attempt of it."""

    def load_on(self, replica: str) -> Load:
        """What a leg of this request puts on ``replica``: its uncached prompt tokens there."""
        return Load({replica: self.routed.prefill_tokens(replica)}, self.routed.request.tenant)

    @property
    def retries(self) -> list[str]:
        """The replicas a failed decode leg is retried on (as a local prefill), in ranked order."""
        decision = self.routed.decision
        return [name for name in decision.ranked if name != decision.replica]


class Handoff(Protocol):
    """One engine kind's protocol for moving a prefilled request's KV to the replica that decodes it."""

    async def run(self, request: HandoffRequest, send: Send) -> Upstream:
        """The destination's answer (first byte in) or a fallback's; raises ``AttemptFailed`` only when every attempt
        failed. Cancelled (``CancelledError``) when the client leaves: release what the legs hold and re-raise."""
        ...


class Handoffs:
    """The handoff protocol of each engine kind."""

    def __init__(self, by_engine: dict[str, Handoff]) -> None:
        self.by_engine = by_engine

    def of(self, engine: str) -> Handoff | None:
        """The protocol of ``engine``'s replicas, None when kvgate has none for it (the request is then served
        locally on its decode replica)."""
        return self.by_engine.get(engine)
