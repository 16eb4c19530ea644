"""Hot-prefix warm-ups: the gateway side of replication.

:class:`policies.replication.HotPrefixTracker` decides which prefix to warm where (through
:meth:`router.routing.Router.plan_warmups`); this module runs those decisions every ``REPLICATION_INTERVAL_S``: a
prefill-only request (``max_tokens: 1``) of the prefix's own token ids on the target, its KV pulled from a holder
first when the plan says a transfer is cheaper (a failed first leg falls back to prefilling). After that, nothing
here steers traffic: the cost policy sees the target as one more holder and spreads the prefix by queue delay.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from router.fleet import Fleet
from router.metrics import GatewayMetrics
from router.proxy import AttemptFailed, Forward, Proxy
from router.routing import FleetDispatcher, PlannedWarmup, Router
from router.transfers import TransferRunner

log = logging.getLogger("kvgate.app")

REPLICATION_INTERVAL_S = 0.5
"""How often hot prefixes are checked for a warm-up (and cooled ones retired)."""

_encode = msgspec.json.Encoder().encode


class WarmupRunner:
    """Plans warm-ups on a timer and runs each as its own background task (``spawn``)."""

    def __init__(
        self,
        router: Router,
        fleet: Fleet,
        proxy: Proxy,
        transfers: TransferRunner,
        metrics: GatewayMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.router = router
        self.fleet = fleet
        self.proxy = proxy
        self.transfers = transfers
        self.metrics = metrics
        self.spawn = spawn

    async def run(self) -> None:
        """Until cancelled: plan, log retirements, start the planned warm-ups."""
        while True:
            await asyncio.sleep(REPLICATION_INTERVAL_S)
            try:
                planned, retired = self.router.plan_warmups()
            except Exception:  # a planning bug must not end replication for good
                log.exception("replication planning failed")
                continue
            for done in retired:
                log.info("replication retired", extra={"fields": {
                    "prefix": done.prefix_key, "replicas": sorted(done.replicas), "reason": done.reason}})
            for item in planned:
                self.spawn(self.warm(item))

    async def warm(self, item: PlannedWarmup) -> None:
        """One warm-up: a prefill-only request of the prefix's tokens on the target, its KV pulled from the source
        first when ``via`` is ``transfer`` (a failed first leg falls back to prefilling)."""
        warmup, prompt = item.warmup, item.prompt
        log.info("replication started", extra={"fields": {
            "prefix": warmup.prefix_key, "tokens": warmup.prefix_tokens, "target": warmup.target, "via": warmup.via,
            "source": warmup.source, "reason": warmup.reason, "saving_ms_per_s": round(warmup.saving_ms_per_s, 1)}})
        body: dict[str, Any] = {"model": prompt.model, "prompt": prompt.token_ids.tolist(), "max_tokens": 1,
                                "stream": False}
        if prompt.cache_salt is not None:
            body["cache_salt"] = prompt.cache_salt
        headers = {"content-type": "application/json", "x-request-id": f"kvgate-warmup-{uuid.uuid4().hex}"}
        dispatcher = FleetDispatcher(self.fleet, lambda name: warmup.prefix_tokens if name == warmup.target else 0)
        transferred = False
        if warmup.via == "transfer" and warmup.source is not None:
            params = await self.transfers.first_leg("/v1/completions", body, headers, warmup.source, dispatcher)
            if params is not None:
                body["kv_transfer_params"] = params
                transferred = True
        ok = False
        try:
            up = await self.proxy.forward(Forward("/v1/completions", _encode(body), headers, False, [warmup.target], 1),
                                          dispatcher)
            up.ticket.finish(True)
            ok = up.status == 200
        except AttemptFailed as failed:
            log.warning("warm-up of %s failed: %s", warmup.target, failed)
        if transferred:
            tokens = warmup.prefix_tokens
            self.transfers.finished(item.routing.cost_model, tokens, tokens, 0, ok)
        item.routing.hot.warmup_finished(warmup.prefix_key, warmup.target, ok)
        self.metrics.warmup_tokens.inc(warmup.prefix_tokens if ok else 0)
