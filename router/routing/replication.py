"""Hot-prefix replication, the gateway's side: what was hot, which warm-ups to start, and running them.

:class:`kvgate.policies.replication.HotPrefixTracker` (one per model, in :mod:`kvgate.router.routing.model_state`)
decides: it keeps each prefix's decayed request rate and plans which prefix to warm where, within the budgets. This
module feeds it and carries out its plans: every dispatched request's deepest held prefix is recorded
(:meth:`Replication.record`), the prompts of nearly hot prefixes are kept to warm with, and every
``REPLICATION_INTERVAL_S`` the plan is taken and each warm-up run as a prefill-only request (``max_tokens: 1``) of the
prefix's own token ids on the target, its KV pulled from a holder first when the plan says a transfer is cheaper (a
failed first leg falls back to prefilling). After that, nothing here steers traffic: the cost policy sees the target as
one more holder and spreads the prefix by queue delay.

Warm prompts are keyed by chain keys, which are rooted in the request's namespace (its cache salt included), so they
are per tenant.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView
from kvgate.policies.replication import Retired, Warmup
from kvgate.router.apis.openai import COMPLETIONS
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.attempts import Attempts, Load
from kvgate.router.fleet.state import Fleet
from kvgate.router.routing.model_state import ModelRouting, ModelStates
from kvgate.router.routing.records import Routed
from kvgate.router.routing.transfers import TransferRunner
from kvgate.router.routing.views import ReplicaViews
from kvgate.router.upstream.proxy import AttemptFailed, Forward

log = logging.getLogger(__name__)

REPLICATION_INTERVAL_S = 0.5
"""How often hot prefixes are checked for a warm-up (and cooled ones retired)."""
WARM_PROMPTS = 256
"""Prompts of nearly hot prefixes kept to run their warm-ups with (least recently used forgotten first)."""
WARM_PROMPT_HEAT = 0.5
"""A prefix's prompt is kept once its heat reaches this fraction of ``replication.min_saving_ms_per_s``."""

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """What a warm-up sends: the prefix's own token ids, under the same model and cache salt (same namespace)."""

    model: str
    cache_salt: str | None
    token_ids: array[int]


@dataclass(frozen=True, slots=True)
class PlannedWarmup:
    warmup: Warmup
    prompt: WarmPrompt
    routing: ModelRouting


class Replication:
    """Records hot prefixes, plans warm-ups on a timer and runs each as its own background task (``spawn``)."""

    def __init__(
        self,
        models: ModelStates,
        views: ReplicaViews,
        fleet: Fleet,
        index: PrefixIndex,
        attempts: Attempts,
        transfers: TransferRunner,
        metrics: GatewayMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.models = models
        self.views = views
        self.fleet = fleet
        self.index = index
        self.attempts = attempts
        self.transfers = transfers
        self.metrics = metrics
        self.spawn = spawn
        self.on_started: Callable[[int, str], None] | None = None
        """Told of each warm-up this gateway starts (prefix key, target), for its peers (``peers.hints``)."""
        self._warm_prompts: OrderedDict[Hashable, WarmPrompt] = OrderedDict()

    def gateways(self) -> int:
        """Gateways planning warm-ups for this fleet, this one included (its peers whose work reports still count):
        they share the warm-up budget."""
        peer_work = self.fleet.peer_work
        return 1 + (peer_work.peers() if peer_work is not None else 0)

    def record(self, routed: Routed) -> None:
        """Heat of the deepest prefix any replica holds (the chain key of its last block identifies it) and, when the
        request marked one, of its shared prefix (:attr:`~kvgate.router.prompts.tokenizer.TokenizedPrompt.
        shared_tokens`)."""
        block_size = routed.request.block_size
        views = [v for v in routed.views.values() if routed.block_sizes.get(v.name) == block_size]
        deepest = max((v.match.total for v in views), default=0) // block_size
        self._record_prefix(routed, views, deepest)
        tokenized = routed.tokenized
        assert tokenized is not None
        if tokenized.shared_tokens and self.models.settings.replication.marked_prefixes:
            marked = tokenized.shared_tokens // block_size
            if 0 < marked < deepest:
                self._record_prefix(routed, views, marked)

    def _record_prefix(self, routed: Routed, views: list[ReplicaView], blocks: int) -> None:
        """One request's use of its first ``blocks`` blocks: heat for the tracker, and the prompt to warm with."""
        keys = routed.keys
        blocks = min(blocks, len(keys))
        if blocks == 0:
            return
        block_size = routed.request.block_size
        key = keys[blocks - 1]
        tokens = blocks * block_size
        holders = {v.name for v in views if v.match.total >= tokens}
        routing, tokenized = routed.routing, routed.tokenized
        assert routing is not None and tokenized is not None
        now = time.monotonic()
        routing.hot.record(key, tokens, holders, now)
        heat = routing.hot.heat_ms_per_s(key, routing.cost_model, now)
        if heat >= WARM_PROMPT_HEAT * self.models.settings.replication.min_saving_ms_per_s:
            if key not in self._warm_prompts:
                ids = array("I", tokenized.token_ids[:tokens])
                self._warm_prompts[key] = WarmPrompt(routed.request.model, routed.cache_salt, ids)
            self._warm_prompts.move_to_end(key)
            if len(self._warm_prompts) > WARM_PROMPTS:
                self._warm_prompts.popitem(last=False)

    def plan(self) -> tuple[list[PlannedWarmup], list[Retired]]:
        """Warm-ups to start now for hot prefixes, and warmed replicas no longer counted (prefixes that cooled)."""
        now = time.monotonic()
        planned: list[PlannedWarmup] = []
        retired: list[Retired] = []
        for routing in self.models.all():
            retired += routing.hot.retire(routing.cost_model, now)
            routing.margins = routing.hot.cache_margins(self.index.holds, routing.cost_model, now)
            views = [self.views.view(name, PrefixMatch(), routing) for name in self.fleet.replicas]
            for warmup in routing.hot.plan(views, routing.cost_model, now, self.gateways()):
                prompt = self._warm_prompts.get(warmup.prefix_key)
                if prompt is None:
                    routing.hot.warmup_finished(warmup.prefix_key, warmup.target, ok=False)
                    continue
                planned.append(PlannedWarmup(warmup, prompt, routing))
        return planned, retired

    def peer_started(self, prefix_key: int, target: str) -> None:
        """A peer gateway started warming ``target`` with this prefix: plan no warm-up of it meanwhile."""
        now = time.monotonic()
        for routing in self.models.all():
            routing.hot.peer_warmup(prefix_key, target, now)

    def counts(self) -> dict[str, dict[str, int]]:
        """Warm-ups started / failed / skipped and replicas retired, by reason, summed over models (for metrics)."""
        out: dict[str, dict[str, int]] = {}
        for routing in self.models.all():
            for (event, reason), count in routing.hot.counts.items():
                out.setdefault(event, {})
                out[event][reason] = out[event].get(reason, 0) + count
        return out

    async def run(self) -> None:
        """Until cancelled: plan, log retirements, start the planned warm-ups."""
        while True:
            await asyncio.sleep(REPLICATION_INTERVAL_S)
            try:
                planned, retired = self.plan()
            except Exception:  # a planning bug must not end replication for good
                log.exception("replication planning failed")
                continue
            for done in retired:
                log.info("replication retired", extra={"fields": {
                    "prefix": done.prefix_key, "replicas": sorted(done.replicas), "reason": done.reason}})
            for item in planned:
                key = item.warmup.prefix_key
                if self.on_started is not None and isinstance(key, int):
                    self.on_started(key, item.warmup.target)
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
        load = Load({warmup.target: warmup.prefix_tokens})
        transferred = False
        if warmup.via == "transfer" and warmup.source is not None:
            params = await self.transfers.first_leg(COMPLETIONS, body, headers, warmup.source, load)
            if params is not None:
                body["kv_transfer_params"] = params
                transferred = True
        ok = False
        try:
            up = await self.attempts.forward(
                Forward(COMPLETIONS.path, _encode(body), headers, False, [warmup.target], 1), load
            )
            up.settle()
            ok = up.status == 200
        except AttemptFailed as failed:
            log.warning("warm-up of %s failed: %s", warmup.target, failed)
        if transferred:
            tokens = warmup.prefix_tokens
            self.transfers.finished(item.routing.cost_model, tokens, tokens, 0, ok)
        item.routing.hot.warmup_finished(warmup.prefix_key, warmup.target, ok)
        self.metrics.warmup_tokens.inc(warmup.prefix_tokens if ok else 0)
