"""Request → decision: the glue between the parsed request, the prefix index, the fleet and the policy.

For each request: tokenize (off the event loop, :mod:`router.prompts`), derive the namespace and kvgate's block keys
(:mod:`cache_index.keys`), look the keys up in the prefix index, freeze a :class:`ReplicaView` per candidate replica,
and ask the policy. After the choice the prompt's blocks are marked "predicted" on the chosen replica so a burst of
siblings does not all miss before the first ``BlockStored`` arrives. Observed TTFTs feed the per-model calibrator.

Per request this is linear in the prompt (tokenization, keys, lookup) plus linear in the fleet (views, decision),
never their product.
"""

from __future__ import annotations

import dataclasses
import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

from cache_index.index import PrefixIndex
from cache_index.keys import block_keys, namespace_key
from cache_index.match import PrefixMatch
from policies.base import Decision, NoHealthyReplica, Policy, ReplicaView, RouteRequest
from policies.calibration import Calibrator
from policies.config import KvgateConfig, ModelConfig
from policies.cost_model import CostModel
from policies.explain import explain_replicas
from policies.least_loaded import LeastLoadedPolicy
from policies.registry import create_policy
from policies.replication import HotPrefixTracker, Retired, Warmup
from router.fleet import Fleet, LoadTicket
from router.prompts import PromptTokenizer, TokenizedPrompt

Endpoint = Literal["completions", "chat"]

SESSION_MEMORY = 100_000
"""X-Session-ID → last replica entries kept (least recently used forgotten first)."""
WARM_PROMPTS = 256
"""Prompts of nearly hot prefixes kept to run their warm-ups with (least recently used forgotten first)."""
WARM_PROMPT_HEAT = 0.5
"""A prefix's prompt is kept once its heat reaches this fraction of ``replication.min_saving_ms_per_s``."""


@dataclass(slots=True)
class ModelRouting:
    """What routing needs per base model: its settings, cost model, policy and calibrator."""

    config: ModelConfig
    cost_model: CostModel
    policy: Policy
    calibrator: Calibrator | None
    hot: HotPrefixTracker


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


@dataclass(slots=True)
class Routed:
    """A decided request: everything the proxy, the logs and explain need afterwards."""

    request: RouteRequest
    decision: Decision
    views: dict[str, ReplicaView]
    keys: list[int]
    tokenized: TokenizedPrompt
    routing: ModelRouting
    route_ms: float
    cache_salt: str | None = None
    lookup_ms: float = 0.0
    """The prefix-index lookup alone (part of ``route_ms``)."""

    def matched_tokens(self, replica: str) -> int:
        view = self.views.get(replica)
        return min(view.match.total, self.request.prompt_tokens) if view is not None else 0

    def prefill_tokens(self, replica: str) -> int:
        """Uncached prompt tokens the replica must compute (the load a dispatch adds)."""
        return max(0, self.request.prompt_tokens - self.matched_tokens(replica))

    def queue_delay_ms(self, replica: str) -> float:
        view = self.views.get(replica)
        return self.routing.cost_model.queue_delay_ms(view) if view is not None else 0.0


@dataclass(slots=True)
class FleetDispatcher:
    """The proxy's view of the fleet for one request (router.proxy.Dispatcher); ``prefill_tokens(replica)`` is the
    uncached work a dispatch there adds (``Routed.prefill_tokens`` for routed requests)."""

    fleet: Fleet
    prefill_tokens: Callable[[str], int]

    def url_of(self, name: str) -> str | None:
        replica = self.fleet.replicas.get(name)
        return replica.url if replica is not None else None

    def routable(self, name: str) -> bool:
        replica = self.fleet.replicas.get(name)
        return replica is not None and replica.routable()

    def dispatch(self, name: str) -> LoadTicket:
        return self.fleet.dispatch(name, self.prefill_tokens(name))


class Router:
    """Decides where requests go. Rebuilt per-model state on reload; sessions and the index survive reloads."""

    def __init__(
        self,
        config: KvgateConfig,
        fleet: Fleet,
        index: PrefixIndex,
        tokenizer: PromptTokenizer,
        rng: random.Random | None = None,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.tokenizer = tokenizer
        self.tokenizer_models = config.models
        self.rng = rng or random.Random()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._warm_prompts: OrderedDict[Hashable, WarmPrompt] = OrderedDict()
        self._least_loaded = LeastLoadedPolicy(self.rng)
        self.apply_config(config)

    def apply_config(self, config: KvgateConfig) -> None:
        """A new policy file: fresh policies, cost models and hot-prefix trackers per model (calibration restarts
        from the file's values)."""
        self.config = config
        self._models: dict[str, ModelRouting] = {}

    def model_routing(self, base_model: str) -> ModelRouting:
        routing = self._models.get(base_model)
        if routing is None:
            cfg = self.config.model(base_model) or ModelConfig(name=base_model)
            cost_model = CostModel.from_config(self.config, base_model)
            policy = create_policy(self.config.policy.name, self.config, cost_model, self.rng)
            calibrator = Calibrator(self.config.calibration, cfg.prefill) if self.config.calibration.enabled else None
            hot = HotPrefixTracker(self.config.replication)
            routing = self._models[base_model] = ModelRouting(cfg, cost_model, policy, calibrator, hot)
        return routing

    def coefficients(self) -> dict[str, dict[str, float]]:
        """Prefill coefficients in force per model (calibrated or the policy file's), for metrics."""
        prefills = {model: routing.cost_model.prefill for model, routing in self._models.items()}
        return {
            "fixed_ms": {model: p.fixed_ms for model, p in prefills.items()},
            "per_token_ms": {model: p.per_token_ms for model, p in prefills.items()},
            "quadratic_ms": {model: p.quadratic_ms for model, p in prefills.items()},
        }

    def knows_model(self, model: str) -> bool:
        """Served by a healthy replica, or declared in the policy file."""
        return self.config.model(model) is not None or any(m.get("id") == model for m in self.fleet.models())

    def candidates(self, model: str) -> list[str]:
        """Replicas that list ``model`` in their /v1/models, or every replica when none does (not probed yet, or a
        model only the policy file declares)."""
        serving = [
            r.name for r in self.fleet.replicas.values() if any(m.get("id") == model for m in r.served_models)
        ]
        return serving or list(self.fleet.replicas)

    async def route(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        model: str,
        request_id: str,
        session_id: str | None,
        tenant: str | None,
        cache_salt: str | None,
        explain: bool = False,
    ) -> Routed:
        """Tokenize, look up and decide; with ``explain``, the policy also fills in the numbers behind its decision
        (:meth:`explain` shows them). Raises PromptError for a malformed prompt and NoHealthyReplica when the fleet
        is empty."""
        names = self.candidates(model)
        if not names:
            raise NoHealthyReplica(model)
        base_model, lora = self.fleet.base_model_of(model)
        routing = self.model_routing(base_model)
        tokenized = await self.tokenizer.tokenize(base_model, endpoint, body)
        started = time.perf_counter()
        block_size = routing.config.block_size
        namespace = namespace_key(base_model, routing.config.weight_version, cache_salt, lora)
        keys = block_keys(namespace, tokenized.token_ids, block_size)
        lookup_started = time.perf_counter()
        matches = self.index.lookup(keys, block_size) if keys else {}
        lookup_ms = (time.perf_counter() - lookup_started) * 1000.0
        last = self._sessions.get(session_id) if session_id else None
        views = {
            name: self.fleet.view(name, matches.get(name) or PrefixMatch(), session_match=name == last)
            for name in names
        }
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        request = RouteRequest(
            request_id=request_id,
            model=model,
            prompt_tokens=len(tokenized.token_ids),
            block_size=block_size,
            approximate=tokenized.approximate,
            session_id=session_id,
            tenant=tenant,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        )
        decision = routing.policy.decide(request, list(views.values()), explain=explain)
        route_ms = (time.perf_counter() - started) * 1000.0 + tokenized.cpu_ms
        return Routed(request, decision, views, keys, tokenized, routing, route_ms, cache_salt, lookup_ms)

    def route_passthrough(self, model: str) -> Decision:
        """Least-loaded choice for requests with no prompt to match (embeddings)."""
        names = self.candidates(model)
        if not names:
            raise NoHealthyReplica(model)
        views = [self.fleet.view(name, PrefixMatch()) for name in names]
        request = RouteRequest(request_id="", model=model, prompt_tokens=0, block_size=1)
        return self._least_loaded.decide(request, views)

    def dispatched(self, routed: Routed, replica: str) -> None:
        """The request is on its way to ``replica``: predict its blocks there, remember the session's replica, count
        its prefix's heat."""
        if routed.keys:
            self.index.predict(replica, routed.keys)
            self._record_prefix(routed)
        session_id = routed.request.session_id
        if session_id:
            self._sessions[session_id] = replica
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > SESSION_MEMORY:
                self._sessions.popitem(last=False)

    def _record_prefix(self, routed: Routed) -> None:
        """Heat of the deepest prefix any replica holds (the chain key of its last block identifies it)."""
        block_size = routed.request.block_size
        deepest = max((v.match.total for v in routed.views.values()), default=0)
        blocks = min(deepest // block_size, len(routed.keys))
        if blocks == 0:
            return
        key = routed.keys[blocks - 1]
        tokens = blocks * block_size
        holders = {name for name, v in routed.views.items() if v.match.total >= tokens}
        routing = routed.routing
        now = time.monotonic()
        routing.hot.record(key, tokens, holders, now)
        heat = routing.hot.heat_ms_per_s(key, routing.cost_model, now)
        if heat >= WARM_PROMPT_HEAT * self.config.replication.min_saving_ms_per_s:
            if key not in self._warm_prompts:
                ids = array("I", routed.tokenized.token_ids[:tokens])
                self._warm_prompts[key] = WarmPrompt(routed.request.model, routed.cache_salt, ids)
            self._warm_prompts.move_to_end(key)
            if len(self._warm_prompts) > WARM_PROMPTS:
                self._warm_prompts.popitem(last=False)

    def plan_warmups(self) -> tuple[list[PlannedWarmup], list[Retired]]:
        """Warm-ups to start now for hot prefixes, and warmed replicas no longer counted (prefixes that cooled)."""
        now = time.monotonic()
        planned: list[PlannedWarmup] = []
        retired: list[Retired] = []
        for routing in self._models.values():
            retired += routing.hot.retire(routing.cost_model, now)
            views = [self.fleet.view(name, PrefixMatch()) for name in self.fleet.replicas]
            for warmup in routing.hot.plan(views, routing.cost_model, now):
                prompt = self._warm_prompts.get(warmup.prefix_key)
                if prompt is None:
                    routing.hot.warmup_finished(warmup.prefix_key, warmup.target, ok=False)
                    continue
                planned.append(PlannedWarmup(warmup, prompt, routing))
        return planned, retired

    def replication_counts(self) -> dict[str, dict[str, int]]:
        """Warm-ups started / failed / skipped and replicas retired, by reason, summed over models (for metrics)."""
        out: dict[str, dict[str, int]] = {}
        for routing in self._models.values():
            for (event, reason), count in routing.hot.counts.items():
                out.setdefault(event, {})
                out[event][reason] = out[event].get(reason, 0) + count
        return out

    def observe(self, routed: Routed, replica: str, ttft_ms: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A measured first token: a sample for the model's calibrator (bounded, robust fit). Transfers are not
        prefill samples: their TTFT is a first leg plus a KV pull, and engines do not report pulled tokens as
        cached, so they would read as a whole prompt prefilled implausibly fast."""
        calibrator = routed.routing.calibrator
        if calibrator is None or routed.decision.action == "transfer":
            return
        calibrator.observe(prompt_tokens, cached_tokens, ttft_ms, routed.queue_delay_ms(replica))

    def refresh_calibration(self) -> None:
        """Swap in the calibrators' current fits (a refit costs milliseconds: call this on a timer, not per request)."""
        for routing in self._models.values():
            if routing.calibrator is not None:
                routing.cost_model.prefill = routing.calibrator.current()

    def explain(self, routed: Routed) -> dict[str, Any]:
        """The decision and the numbers behind it, per replica (``POST /kvgate/v1/explain``), for a request routed
        with ``explain=True``."""
        decision = routed.decision
        request = routed.request
        numbers = decision.details.get("replicas")
        if not isinstance(numbers, dict):
            numbers = explain_replicas(request, list(routed.views.values()), routed.routing.cost_model)
        replicas = []
        for name, view in routed.views.items():
            row = dict(numbers.get(name, {}))
            row.pop("cached_tokens", None)
            # The index's generation moves on every restart, AllBlocksCleared and reset (health recovery included);
            # the fleet's counts health recoveries only.
            generation = self.index.generation(name)
            replicas.append({
                "name": name,
                "healthy": view.healthy,
                "draining": view.draining,
                "can_source": view.can_source,
                "generation": view.generation if generation is None else generation,
                "cached_tokens": view.match.as_dict(),
                "queue_delay_ms": row.pop("queue_delay_ms", 0.0),
                "predicted_ttft_ms": row.pop("predicted_ttft_ms", 0.0),
                "in_flight": view.in_flight,
                **row,
            })
        prefill = routed.routing.cost_model.prefill
        calibrator = routed.routing.calibrator
        extra = {k: v for k, v in decision.details.items() if k != "replicas"}
        return {
            "prompt_tokens": request.prompt_tokens,
            "approximate": request.approximate,
            "tokenizer": routed.tokenized.source,
            "block_size": request.block_size,
            "blocks": len(routed.keys),
            "policy": self.config.policy.name,
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
                "calibration": None if calibrator is None else dataclasses.asdict(calibrator.state()),
            },
            "route_ms": round(routed.route_ms, 3),
        }
