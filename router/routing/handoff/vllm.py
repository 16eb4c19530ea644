"""vLLM's handoff (NixlConnector), as vLLM's own disaggregation proxy runs it: the prompt prefilled on the source as
a prefill-only request (``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens: 1``, not streamed;
:func:`kvgate.router.routing.transfers.prefill_for_transfer`), then the client's request sent to the destination with
the ``kv_transfer_params`` the source answered, so its engine pulls the KV instead of computing it. Both legs carry
the client's ``X-Request-Id``."""

from __future__ import annotations

import logging

import msgspec

from kvgate.router.fleet.attempts import Upstream
from kvgate.router.routing.handoff.base import HandoffRequest, Send
from kvgate.router.routing.transfers import TransferRunner, kind_of
from kvgate.router.upstream.proxy import AttemptFailed

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


class VllmHandoff:
    """Two legs in sequence. A first leg that fails, times out or answers without ``kv_transfer_params``: the
    destination prefills locally (the client's request unchanged). A decode leg that fails before its first byte:
    the next ranked replica prefills locally, never with the same parameters — the source frees the blocks once a
    destination has read them, and a second read could find them reused."""

    def __init__(self, transfers: TransferRunner) -> None:
        self.transfers = transfers

    async def run(self, request: HandoffRequest, send: Send) -> Upstream:
        routed = request.routed
        decision = routed.decision
        assert decision.source is not None
        params = await self.transfers.first_leg(
            request.api, request.body, request.headers, decision.source, request.load_on(decision.source),
            kind_of(routed), request.trace,
        )
        if params is None:
            log.warning("prefill leg on %s failed: prefilling on %s", decision.source, decision.replica)
            return await send(request.raw, [decision.replica, *request.retries])
        pulled = _encode({**request.body, "kv_transfer_params": params})
        try:
            up = await send(pulled, [decision.replica])
        except AttemptFailed:
            self.transfers.finished_for(routed, ok=False)
            if not request.retries:
                raise
            log.warning("decode leg on %s failed before its first byte: prefilling on %s instead",
                        decision.replica, request.retries[0])
            return await send(request.raw, request.retries)
        self.transfers.finished_for(routed, ok=up.status == 200)
        return up
