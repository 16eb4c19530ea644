"""Request → decision: the tokenize and route stages of the request path, between the prefix index, the fleet and
the policy.

:meth:`Router.tokenize` finds the replicas that may serve the model and tokenizes the prompt as the engine will (off
the event loop, :mod:`kvgate.router.prompts.tokenizer`). :meth:`Router.route` derives the namespace and kvgate's block
keys (:mod:`kvgate.cache_index.keys`), looks the keys up in the prefix index, freezes a :class:`ReplicaView` per
candidate replica and asks the policy. Once the request is sent, :meth:`Router.dispatched` marks the prompt's blocks
"predicted" on the replica, so a burst of siblings does not all miss before the first ``BlockStored`` arrives.

Every cache on this path is kept per namespace (the request's cache salt, which is per tenant): the tokenizer's
pieces, sessions (:mod:`kvgate.router.routing.sessions`), warm prompts (:mod:`kvgate.router.routing.replication`) and
the index itself, so no tenant's request is faster, or routed differently, because of another tenant's.

Per request this is linear in the prompt (tokenization, keys, lookup) plus linear in the fleet (views, decision),
never their product.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch, reusable_blocks
from kvgate.policies.base import Decision, NoHealthyReplica, Policy, ReplicaView, RouteRequest
from kvgate.policies.calibration import Calibrator
from kvgate.policies.capacity import CacheMargin
from kvgate.policies.config import ModelConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.least_loaded import LeastLoadedPolicy
from kvgate.policies.registry import create_policy
from kvgate.policies.replication import HotPrefixTracker
from kvgate.router.config import KvgateConfig
from kvgate.router.fleet.block_sizes import BlockSizes
from kvgate.router.fleet.state import Fleet, LoadTicket
from kvgate.router.prompts.tokenizer import PromptError, PromptTokenizer, TokenizedPrompt
from kvgate.router.routing.sessions import SessionMemory

Endpoint = Literal["completions", "chat"]

@dataclass(slots=True)
class ModelRouting:
    """What routing needs per base model: its settings, cost model, policy and calibrator."""

    config: ModelConfig
    cost_model: CostModel
    policy: Policy
    calibrator: Calibrator | None
    hot: HotPrefixTracker
    margins: dict[str, CacheMargin] = dataclasses.field(default_factory=dict)
    """Per replica, its cache's value at the margin, refreshed with the replication plan (every
    ``REPLICATION_INTERVAL_S``): the tracker's rates and recency against the index's holdings."""


@dataclass(slots=True)
class Prompt:
    """A request's prompt, tokenized and ready to route (the tokenize stage's output)."""

    model: str
    base_model: str
    lora: str | None
    candidates: list[str]
    """The replicas that may serve the model."""
    routing: ModelRouting
    tokenized: TokenizedPrompt
    cache_salt: str | None
    max_tokens: int | None


@dataclass(slots=True)
class Routed:
    """A decided request: everything the proxy, the logs and explain need afterwards."""

    request: RouteRequest
    decision: Decision
    views: dict[str, ReplicaView]
    keys_by_block_size: dict[int, list[int]]
    """The prompt's block keys (every full block) for each block size the candidate replicas use."""
    block_sizes: dict[str, int]
    """Each candidate replica's block size."""
    tokenized: TokenizedPrompt
    routing: ModelRouting
    route_ms: float
    cache_salt: str | None = None
    lookup_ms: float = 0.0
    """The prefix-index lookup alone (part of ``route_ms``)."""

    def keys_for(self, replica: str) -> list[int]:
        """The prompt's block keys as ``replica`` hashes them (its block size)."""
        size = self.block_sizes.get(replica, self.request.block_size)
        return self.keys_by_block_size.get(size, [])

    @property
    def keys(self) -> list[int]:
        """The prompt's block keys as the chosen replica hashes them."""
        return self.keys_for(self.decision.replica)

    def matched_tokens(self, replica: str) -> int:
        view = self.views.get(replica)
        return min(view.match.total, self.request.prompt_tokens) if view is not None else 0

    def prefill_tokens(self, replica: str) -> int:
        """Uncached prompt tokens the replica must compute (the load a dispatch adds)."""
        return max(0, self.request.prompt_tokens - self.matched_tokens(replica))

    def queue_delay_ms(self, replica: str) -> float:
        view = self.views.get(replica)
        return self.routing.cost_model.queue_delay_ms(view) if view is not None else 0.0

    def predicted_ttft_ms(self, replica: str) -> float | None:
        """The cost model's TTFT for this request on ``replica`` (queue delay included), as the fleet looked when
        the request was routed; None for a replica that was not a candidate."""
        view = self.views.get(replica)
        return self.routing.cost_model.estimate(self.request, view).ttft_ms if view is not None else None


@dataclass(slots=True)
class FleetDispatcher:
    """The proxy's view of the fleet for one request (:class:`kvgate.router.upstream.proxy.Dispatcher`);
    ``prefill_tokens(replica)`` is the uncached work a dispatch there adds (``Routed.prefill_tokens`` for routed
    requests), ``caller`` the tenant whose request it is."""

    fleet: Fleet
    prefill_tokens: Callable[[str], int]
    caller: str | None = None

    def url_of(self, name: str) -> str | None:
        replica = self.fleet.replicas.get(name)
        return replica.url if replica is not None else None

    def routable(self, name: str) -> bool:
        replica = self.fleet.replicas.get(name)
        return replica is not None and replica.routable()

    def dispatch(self, name: str) -> LoadTicket:
        return self.fleet.dispatch(name, self.prefill_tokens(name), self.caller)


class Router:
    """Decides where requests go. Rebuilt per-model state on reload; sessions and the index survive reloads."""

    def __init__(
        self,
        config: KvgateConfig,
        fleet: Fleet,
        index: PrefixIndex,
        tokenizer: PromptTokenizer,
        rng: random.Random | None = None,
        block_sizes: BlockSizes | None = None,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.block_sizes = block_sizes or BlockSizes(lambda _: None, lambda _: None)
        """Each replica's block size (learned from its engine; the policy file's is the default)."""
        self.tokenizer = tokenizer
        self.tokenizer_models = config.models
        self.rng = rng or random.Random()
        self.sessions = SessionMemory(config.limits.max_sessions_per_tenant)
        self._least_loaded = LeastLoadedPolicy(self.rng)
        self.on_predicted: Callable[[str, Sequence[int]], None] | None = None
        """Told every prediction this router makes (the routing hints its peers receive)."""
        self.apply_config(config)

    def apply_config(self, config: KvgateConfig) -> None:
        """A new policy file: fresh policies, cost models and hot-prefix trackers per model (calibration restarts
        from the file's values)."""
        self.config = config
        self._models: dict[str, ModelRouting] = {}
        self.sessions.capacity_per_tenant = config.limits.max_sessions_per_tenant

    def model_routing(self, base_model: str) -> ModelRouting:
        routing = self._models.get(base_model)
        if routing is None:
            cfg = self.config.model(base_model) or ModelConfig(name=base_model)
            config = self.config
            cost_model = CostModel.from_config(config.model_or_first(base_model), config.policy, config.transfer)
            policy = create_policy(config.policy.name, config.policy, cost_model, self.rng, config.disaggregation)
            calibrator = Calibrator(self.config.calibration, cfg.prefill) if self.config.calibration.enabled else None
            hot = HotPrefixTracker(self.config.replication)
            routing = self._models[base_model] = ModelRouting(cfg, cost_model, policy, calibrator, hot)
        return routing

    def model_routings(self) -> list[ModelRouting]:
        """The per-model state built so far (models that have seen a request since the last reload)."""
        return list(self._models.values())

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

    def _takes_requests(self, names: list[str]) -> bool:
        """Whether one of ``names`` takes client requests (prefill replicas only run disaggregated prefill legs)."""
        replicas = self.fleet.replicas
        return any(replicas[name].config.role != "prefill" for name in names)

    async def tokenize(
        self, endpoint: Endpoint, body: dict[str, Any], *, model: str, cache_salt: str | None, body_bytes: int = 0
    ) -> Prompt:
        """The tokenize stage: the replicas that may serve ``model``, its per-model state, and the prompt's token ids
        as the engine will see them (``body_bytes``: the body's size, which decides whether that runs on a worker
        thread). Raises NoHealthyReplica when no replica may serve it (before tokenizing), and PromptError for a
        malformed prompt or one longer than the model takes."""
        names = self.candidates(model)
        if not self._takes_requests(names):
            raise NoHealthyReplica(model)
        base_model, lora = self.fleet.base_model_of(model)
        routing = self.model_routing(base_model)
        limit = self.max_model_len(base_model)
        tokenized = await self.tokenizer.tokenize(base_model, endpoint, body, namespace=cache_salt,
                                                  body_bytes=body_bytes, max_model_len=limit)
        _check_length(limit, tokenized, endpoint)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        return Prompt(model, base_model, lora, names, routing, tokenized, cache_salt,
                      max_tokens if isinstance(max_tokens, int) else None)

    def route(
        self, prompt: Prompt, *, request_id: str, session_id: str | None, tenant: str | None, explain: bool = False
    ) -> Routed:
        """The route stage: key the prompt's blocks, look them up in the index and let the policy decide; with
        ``explain``, the policy also fills in the numbers behind its decision. ``route_ms`` is this stage's time
        plus the tokenizer's CPU time."""
        started = time.perf_counter()
        names, routing, tokenized, cache_salt = prompt.candidates, prompt.routing, prompt.tokenized, prompt.cache_salt
        base_model, lora = prompt.base_model, prompt.lora
        token_ids = tokenized.token_ids
        model_config = self.config.model(base_model)
        block_sizes = {name: self.block_sizes.of(name, model_config) for name in names}
        namespace = namespace_key(base_model, routing.config.weight_version, cache_salt, lora)
        keys_by_block_size: dict[int, list[int]] = {}
        matches: dict[str, PrefixMatch] = {}
        lookup_ms = 0.0
        for block_size in set(block_sizes.values()):
            keys = keys_by_block_size[block_size] = block_keys(namespace, token_ids, block_size)
            # The engine always computes the prompt's last token, so a prompt ending on a block boundary reuses
            # one block less than it holds: only the reusable blocks are looked up and credited.
            reusable = keys[: reusable_blocks(len(token_ids), block_size)]
            lookup_started = time.perf_counter()
            found = self.index.lookup(reusable, block_size) if reusable else {}
            lookup_ms += (time.perf_counter() - lookup_started) * 1000.0
            for name, size in block_sizes.items():  # a replica's match counts only under its own block size
                if size == block_size and name in found:
                    matches[name] = self._surviving_match(name, reusable, found[name], block_size)
        last = self.sessions.last_replica(tenant, cache_salt, session_id)
        views = {
            name: self.with_capacity(
                self.fleet.view(name, matches.get(name) or PrefixMatch(), session_match=name == last), routing
            )
            for name in names
        }
        request = RouteRequest(
            request_id=request_id,
            model=prompt.model,
            prompt_tokens=len(token_ids),
            block_size=block_sizes[names[0]],
            approximate=tokenized.approximate,
            session_id=session_id,
            tenant=tenant,
            max_tokens=prompt.max_tokens,
        )
        decision = routing.policy.decide(request, list(views.values()), explain=explain)
        if block_sizes.get(decision.replica, request.block_size) != request.block_size:
            request = dataclasses.replace(request, block_size=block_sizes[decision.replica])
        route_ms = (time.perf_counter() - started) * 1000.0 + tokenized.cpu_ms
        return Routed(
            request, decision, views, keys_by_block_size, block_sizes, tokenized, routing, route_ms, cache_salt,
            lookup_ms,
        )

    def _surviving_match(self, name: str, keys: list[int], match: PrefixMatch, block_size: int) -> PrefixMatch:
        """``match`` without the blocks the replica will have evicted before it schedules a request sent now.

        vLLM announces an eviction only at the end of the step that made it, so on a full cache the least recently
        used blocks are credited while the requests already on their way (their uncached tokens, still to be
        allocated) evict them. The index cuts the match at its first block within that reach."""
        replica = self.fleet.replicas.get(name)
        scraped = None if replica is None else self.fleet.fresh_scrape(replica)
        if replica is None or scraped is None or not scraped.num_gpu_blocks:
            return match
        matched = match.total // block_size
        incoming = -(-replica.in_flight_prefill_tokens // block_size)
        kept = self.index.surviving_blocks(name, keys[:matched], scraped.num_gpu_blocks, incoming)
        if kept == matched:
            return match
        return self.index.lookup(keys[:kept], block_size).get(name) or PrefixMatch() if kept else PrefixMatch()

    def with_capacity(self, view: ReplicaView, routing: ModelRouting) -> ReplicaView:
        """``view`` with its cache's capacity (scraped), holdings (the index's) and margin filled in, for the cost of
        what a request's new blocks evict there."""
        replica = self.fleet.replicas.get(view.name)
        scraped = None if replica is None else self.fleet.fresh_scrape(replica)
        if scraped is not None and scraped.num_gpu_blocks and scraped.block_size:
            view.kv_capacity_tokens = scraped.num_gpu_blocks * scraped.block_size
            view.kv_held_tokens = self.index.held_blocks(view.name) * routing.config.block_size
        view.cache_margin = routing.margins.get(view.name)
        return view

    def max_model_len(self, base_model: str) -> int | None:
        """The model's longest prompt: the policy file's ``max_model_len``, else the largest its replicas report."""
        configured = self.config.model(base_model)
        if configured is not None and configured.max_model_len is not None:
            return configured.max_model_len
        reported = [
            m["max_model_len"] for r in self.fleet.replicas.values() for m in r.served_models
            if m.get("id") == base_model and type(m.get("max_model_len")) is int and m["max_model_len"] > 0
        ]
        return max(reported, default=None)

    def route_passthrough(self, model: str) -> Decision:
        """Least-loaded choice for requests with no prompt to match (embeddings)."""
        names = self.candidates(model)
        if not self._takes_requests(names):
            raise NoHealthyReplica(model)
        views = [self.fleet.view(name, PrefixMatch()) for name in names]
        request = RouteRequest(request_id="", model=model, prompt_tokens=0, block_size=1)
        return self._least_loaded.decide(request, views)

    def dispatched(self, routed: Routed, replica: str) -> bool:
        """The request is on its way to ``replica``: predict its blocks there and remember the session's replica.
        Whether the prompt had blocks to predict (a prefix whose heat counts)."""
        predicted = self.predict(routed, replica)
        session_id = routed.request.session_id
        if session_id:
            self.sessions.remember(routed.request.tenant, routed.cache_salt, session_id, replica)
        return predicted

    def predict(self, routed: Routed, replica: str) -> bool:
        """``replica`` is computing the prompt (serving it, or prefilling it for another replica): its blocks are
        predicted there (and shared with the peers). Whether the prompt had blocks to predict."""
        keys = routed.keys_for(replica)
        if keys:
            self.index.touch(replica, keys)
            self.index.predict(replica, keys)
            if self.on_predicted is not None:
                self.on_predicted(replica, keys)
        return bool(keys)

    def refresh_calibration(self) -> None:
        """Swap in the calibrators' current fits (a refit costs milliseconds: call this on a timer, not per request)."""
        for routing in self._models.values():
            if routing.calibrator is not None:
                routing.cost_model.prefill = routing.calibrator.current()


def _check_length(limit: int | None, tokenized: TokenizedPrompt, endpoint: Endpoint) -> None:
    """A prompt longer than the model takes (``limit`` tokens) is a 400 here, as the engine would answer
    (approximate counts are not exact enough to refuse on)."""
    tokens = len(tokenized.token_ids)
    if limit is not None and tokens > limit and not tokenized.approximate:
        raise PromptError(
            f"This model's maximum context length is {limit} tokens. However, your request has {tokens} input "
            "tokens. Please reduce the length of the input.",
            "messages" if endpoint == "chat" else "prompt", "context_length_exceeded",
        )
