"""KV transfers: vLLM's NixlConnector first leg, run for a routed request (a warm transfer or a disaggregated
request, :mod:`kvgate.router.routing.handoff.vllm`) or a warm-up, and counted.

A transfer is two requests. The first leg sends the prompt to the warm source as a prefill-only request
(``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens: 1``; :func:`prefill_for_transfer`) and gets back
the parameters that locate the source's KV blocks; the second sends the real request to the destination with those
parameters, so its engine pulls the blocks instead of recomputing them. A first leg that fails or times out
is a fallback: the destination recomputes, and the client never sees the handshake.

The metrics say whether moving KV pays, by kind (a warm transfer or a disaggregated request): handshakes started /
completed / failed / fallen back, first-leg seconds, bytes moved (cost-model bytes per token) and the prefill the
fleet skipped because of them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import msgspec

from kvgate.policies.config import TransferConfig
from kvgate.policies.cost_model import CostModel
from kvgate.router.apis.base import Api
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.core.trace_context import AttemptTracing
from kvgate.router.fleet.attempts import Attempts, Load
from kvgate.router.routing.records import Routed
from kvgate.router.upstream.proxy import AttemptFailed, Forward

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The first leg of vLLM's NixlConnector handshake, as vLLM's own toy proxy sends it."""


def first_leg_body(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill-only request of a transfer: same prompt, one token, not streamed (the API's own form of that),
    KV kept for the destination."""
    return {**api.prefill_only(body), "kv_transfer_params": dict(NIXL_PREFILL_PARAMS)}


async def prefill_for_transfer(
    attempts: Attempts, api: Api, body: dict[str, Any], headers: dict[str, str], source: str, load: Load,
    timeout_s: float, trace: AttemptTracing | None = None,
) -> dict[str, Any] | None:
    """First leg of vLLM's NixlConnector handshake: prefill the prompt on ``source`` (one token, not streamed,
    same X-Request-Id) so its KV stays held for the destination; the ``kv_transfer_params`` the destination needs,
    or None when the leg failed, timed out or answered without them. A traced request's leg is one of its
    attempts."""
    leg = Forward(api.path, _encode(first_leg_body(api, body)), headers, False, [source], 1, trace=trace)
    try:
        async with asyncio.timeout(timeout_s):
            up = await attempts.forward(leg, load)
    except (AttemptFailed, TimeoutError):
        return None
    up.settle()
    if up.status != 200:
        return None
    try:
        params = _decode(up.body).get("kv_transfer_params")
    except (msgspec.DecodeError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


Kind = Literal["transfer", "disaggregated"]
"""What a handshake is for (:data:`kvgate.router.core.metrics.TRANSFER_KINDS`)."""


def kind_of(routed: Routed) -> Kind:
    """A routed request's handshake kind: a disaggregated one's, else a warm transfer's."""
    return "disaggregated" if routed.decision.action == "disaggregate" else "transfer"


class TransferRunner:
    """Runs first legs and accounts for what each handshake moved and saved, by kind."""

    def __init__(self, attempts: Attempts, metrics: GatewayMetrics, config: TransferConfig) -> None:
        self.attempts = attempts
        self.metrics = metrics
        self.config = config

    def reconfigure(self, config: TransferConfig) -> None:
        self.config = config

    async def first_leg(
        self, api: Api, body: dict[str, Any], headers: dict[str, str], source: str, load: Load,
        kind: Kind = "transfer", trace: AttemptTracing | None = None,
    ) -> dict[str, Any] | None:
        """The prefill-only request on ``source``, counted: a handshake started, and the leg's duration (a failed
        leg is a fallback)."""
        m = self.metrics
        m.transfers[kind, "started"].inc()
        began = time.monotonic()
        params = await prefill_for_transfer(self.attempts, api, body, headers, source, load,
                                            self.config.first_leg_timeout_s, trace)
        m.transfer_seconds[kind, "fallback" if params is None else "completed"].observe(time.monotonic() - began)
        if params is None:
            m.transfers[kind, "fallback"].inc()
        return params

    def finished_for(self, routed: Routed, *, ok: bool) -> None:
        """:meth:`finished` for a routed request, from the index's matches at its decision."""
        decision = routed.decision
        assert decision.source is not None and routed.routing is not None
        room = max(routed.request.prompt_tokens - 1, 0)  # the destination always computes the last token itself
        self.finished(
            routed.routing.cost_model, routed.request.prompt_tokens,
            min(routed.matched_tokens(decision.source), room), min(routed.matched_tokens(decision.replica), room), ok,
            kind_of(routed),
        )

    def finished(
        self, cost_model: CostModel, prompt_tokens: int, source_held: int, dest_held: int, ok: bool,
        kind: Kind = "transfer",
    ) -> None:
        """The destination's answer to a request carrying pulled KV. Completed: the KV of every token it lacked
        crossed the link (cost-model bytes), and the fleet skipped prefilling what the source held beyond it (for
        a disaggregated request, the prefill replica computed the rest: it was moved, not skipped)."""
        m = self.metrics
        if not ok:
            m.transfers[kind, "failed"].inc()
            return
        m.transfers[kind, "completed"].inc()
        m.transfer_bytes[kind].inc((prompt_tokens - dest_held) * cost_model.kv_bytes_per_token)
        saved_ms = (cost_model.prefill_avoided_ms(prompt_tokens, source_held)
                    - cost_model.prefill_avoided_ms(prompt_tokens, dest_held))
        m.transfer_prefill_avoided[kind].inc(max(0.0, saved_ms) / 1000.0)
