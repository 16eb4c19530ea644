"""KV transfers: vLLM's NixlConnector handshake run for a routed request or a warm-up, and counted.

A transfer is two requests. The first leg sends the prompt to the warm source as a prefill-only request
(``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens: 1``; :meth:`router.proxy.Proxy.prefill_for_transfer`)
and gets back the parameters that locate the source's KV blocks; the second sends the real request to the destination
with those parameters, so its engine pulls the blocks instead of recomputing them. A first leg that fails or times out
is a fallback: the destination recomputes, and the client never sees the handshake.

The metrics say whether moving KV pays: transfers started / completed / failed / fallen back, first-leg seconds,
bytes moved (cost-model bytes per token) and the prefill the fleet skipped because of them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from policies.cost_model import CostModel
from router.metrics import GatewayMetrics, prefill_avoided_ms
from router.proxy import Proxy
from router.reload import ConfigHolder
from router.routing import FleetDispatcher, Routed

log = logging.getLogger("kvgate.app")

_encode = msgspec.json.Encoder().encode


class TransferRunner:
    """Runs first legs and accounts for what each transfer moved and saved."""

    def __init__(self, proxy: Proxy, metrics: GatewayMetrics, holder: ConfigHolder) -> None:
        self.proxy = proxy
        self.metrics = metrics
        self.holder = holder

    async def pull(
        self, path: str, body: dict[str, Any], raw: bytes, headers: dict[str, str], routed: Routed,
        dispatcher: FleetDispatcher,
    ) -> tuple[bytes, bool]:
        """The destination's body for a routed request and whether it carries the source's ``kv_transfer_params``:
        it does when the first leg worked, else it is the original (the destination recomputes)."""
        source = routed.decision.source
        assert source is not None
        params = await self.first_leg(path, body, headers, source, dispatcher)
        if params is None:
            log.warning("transfer from %s failed: recomputing on %s", source, routed.decision.replica)
            return raw, False
        return _encode({**body, "kv_transfer_params": params}), True

    async def first_leg(
        self, path: str, body: dict[str, Any], headers: dict[str, str], source: str, dispatcher: FleetDispatcher
    ) -> dict[str, Any] | None:
        """The prefill-only request on ``source``, counted: a transfer started, and the leg's duration (a failed
        leg is a fallback)."""
        m = self.metrics
        m.transfers["started"].inc()
        began = time.monotonic()
        params = await self.proxy.prefill_for_transfer(
            path, body, headers, source, dispatcher, self.holder.current.transfer.first_leg_timeout_s
        )
        m.transfer_seconds["fallback" if params is None else "completed"].observe(time.monotonic() - began)
        if params is None:
            m.transfers["fallback"].inc()
        return params

    def finished_for(self, routed: Routed, *, ok: bool) -> None:
        """:meth:`finished` for a routed request, from the index's matches at its decision."""
        decision = routed.decision
        assert decision.source is not None
        room = max(routed.request.prompt_tokens - 1, 0)  # the destination always computes the last token itself
        self.finished(
            routed.routing.cost_model, routed.request.prompt_tokens,
            min(routed.matched_tokens(decision.source), room), min(routed.matched_tokens(decision.replica), room), ok,
        )

    def finished(self, cost_model: CostModel, prompt_tokens: int, source_held: int, dest_held: int, ok: bool) -> None:
        """The destination's answer to a request carrying pulled KV. Completed: the KV of every token it lacked
        crossed the link (cost-model bytes), and the fleet skipped prefilling what the source held beyond it."""
        m = self.metrics
        if not ok:
            m.transfers["failed"].inc()
            return
        m.transfers["completed"].inc()
        m.transfer_bytes.inc((prompt_tokens - dest_held) * cost_model.kv_bytes_per_token)
        saved_ms = prefill_avoided_ms(cost_model, prompt_tokens, source_held) - prefill_avoided_ms(
            cost_model, prompt_tokens, dest_held
        )
        m.transfer_prefill_avoided.inc(max(0.0, saved_ms) / 1000.0)
