"""The route stage: the prompt's block keys (each block size the candidates use), the reusable blocks looked up in the
prefix index, one view per candidate replica, the policy's decision, and the attempts' plan: the ranked replicas an
attempt may go to and each one's first-byte deadline, handed to the proxy as data.

Every cache on this path is kept per namespace (the request's cache salt, which is per tenant): the tokenizer's
pieces, sessions, warm prompts, recent prompts' block keys and the index itself, so no tenant's request is faster,
or routed differently, because of another tenant's. Per request this is linear in the prompt (keys, lookup) plus
linear in the fleet (views, decision), never their product.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.keys import RecentBlockKeys, namespace_key
from kvgate.cache_index.match import PrefixMatch, reusable_blocks
from kvgate.policies.base import Decision, NoHealthyReplica, ReplicaView, RouteRequest
from kvgate.policies.least_loaded import LeastLoadedPolicy
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.block_sizes import BlockSizes
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.errors import routing_errors
from kvgate.router.prompts.tokenizer import TokenizedPrompt
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.records import Prompt, Routed
from kvgate.router.routing.sessions import SessionMemory
from kvgate.router.routing.views import ReplicaViews
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.proxy import first_byte_deadline_s


class RouteStage:
    def __init__(
        self, catalog: ModelCatalog, index: PrefixIndex, block_sizes: BlockSizes, views: ReplicaViews,
        sessions: SessionMemory, metrics: GatewayMetrics, proxy: ProxyConfig, rng: random.Random,
    ) -> None:
        self.catalog = catalog
        self.index = index
        self.block_sizes = block_sizes
        """Each replica's block size (learned from its engine; the policy file's is the default)."""
        self.views = views
        self.sessions = sessions
        self.metrics = metrics
        self.proxy = proxy
        self._least_loaded_policy = LeastLoadedPolicy(rng)
        self.recent_keys = RecentBlockKeys()
        """Recent prompts' keys: a chat's next turn hashes only its new blocks."""
        self._lead_ends: dict[tuple[int, int], int] = {}
        """(block size, key) of the last full block of each prompt beginning routed on while its rest is tokenized:
        a match ending there may run on once that prompt's whole is predicted."""

    def reconfigure(self, proxy: ProxyConfig) -> None:
        self.proxy = proxy

    def route(self, prompt: Prompt, admission: Admission, stream: bool, *, explain: bool = False) -> Routed:
        """Key the prompt's blocks, look them up in the index and let the policy decide; with ``explain``, the policy
        also fills in the numbers behind its decision (and nothing is counted: nothing is sent). ``route_ms`` is this
        stage's time plus the tokenizer's CPU time. A traced request's decision is recorded on its ``route`` span
        once it is forwarded (:meth:`~kvgate.router.pipeline.spans.RequestTrace.forwarding`). The prompt's token ids
        are all of it (:meth:`~kvgate.router.pipeline.tokenize.TokenizeStage.whole`)."""
        assert prompt.tokenized.rest is None
        if admission.trace is not None:
            admission.trace.stage("route")
        with routing_errors():
            routed = self._route(prompt, admission, stream, explain)
        assert routed is not None
        return routed

    def route_lead(self, prompt: Prompt, admission: Admission, stream: bool) -> Routed | None:
        """:meth:`route` for a prompt whose rest is still being tokenized
        (:attr:`~kvgate.router.prompts.tokenizer.TokenizedPrompt.rest`), on its beginning and its estimated length,
        when that decides it: no replica holds (or is predicted to hold) a prefix reaching the beginning's last full
        block, so the rest cannot change any replica's match, and the decision is a plain route. Otherwise None: the
        whole prompt is needed. The returned request's :attr:`~Routed.completed` resolves once its ids, keys and
        count are the whole prompt's."""
        if admission.trace is not None:
            admission.trace.stage("route")
        with routing_errors():
            return self._route(prompt, admission, stream, explain=False)

    async def route_tokenized(
        self, prompt: Prompt, admission: Admission, stream: bool, whole: Callable[[Prompt], Awaitable[Prompt]],
    ) -> Routed:
        """:meth:`route` for a prompt tokenized with ``lead``: on its beginning when :meth:`route_lead` decides it
        there, else once ``whole`` (:meth:`~kvgate.router.pipeline.tokenize.TokenizeStage.whole`) gives all of it."""
        rest = prompt.tokenized.rest
        if rest is not None:
            if not rest.done():
                routed = self.route_lead(prompt, admission, stream)
                if routed is not None:
                    return routed
            prompt = await whole(prompt)
        return self.route(prompt, admission, stream)

    def _route(self, prompt: Prompt, admission: Admission, stream: bool, explain: bool) -> Routed | None:
        started = time.perf_counter()
        names, routing, tokenized, cache_salt = prompt.candidates, prompt.routing, prompt.tokenized, prompt.cache_salt
        token_ids = tokenized.token_ids
        lead = tokenized.rest is not None
        model_config = self.catalog.config_of(prompt.base_model)
        block_sizes = {name: self.block_sizes.of(name, model_config) for name in names}
        namespace = namespace_key(prompt.base_model, routing.config.weight_version, cache_salt, prompt.lora)
        session_id, tenant = admission.client.session_id, admission.tenant
        keys_by_block_size: dict[int, Sequence[int]] = {}
        matches: dict[str, PrefixMatch] = {}
        lookup_ms = 0.0
        for block_size in set(block_sizes.values()) if not prompt.partial else ():
            keys = self.recent_keys.keys(namespace, token_ids, block_size, session_id)
            keys_by_block_size[block_size] = keys
            # The engine always computes the prompt's last token, so a prompt ending on a block boundary reuses
            # one block less than it holds: only the reusable blocks are looked up and credited. Every full block
            # of a prompt's beginning is reusable: the whole prompt is longer.
            reusable = keys if lead else keys[: reusable_blocks(len(token_ids), block_size)]
            lookup_started = time.perf_counter()
            found = self.index.lookup(reusable, block_size) if reusable else {}
            lookup_ms += (time.perf_counter() - lookup_started) * 1000.0
            if lead and not settled(reusable, found, block_size, self._lead_ends):
                return None
            for name, size in block_sizes.items():  # a replica's match counts only under its own block size
                if size == block_size and name in found:
                    matches[name] = self.views.surviving_match(name, reusable, found[name], block_size)
        last = self.sessions.last_replica(tenant, cache_salt, session_id)
        new_session = bool(session_id) and last is None
        views = {
            name: self.views.view(name, matches.get(name) or PrefixMatch(), routing, session_match=name == last)
            for name in names
        }
        request = RouteRequest(
            request_id=admission.request_id,
            model=prompt.model,
            prompt_tokens=tokenized.token_count,
            block_size=block_sizes[names[0]],
            approximate=tokenized.approximate,
            session_id=session_id,
            new_session=new_session,
            session_return_share=self.sessions.return_share(tenant) if new_session else 1.0,
            tenant=tenant,
            max_tokens=prompt.max_tokens,
        )
        decision = routing.policy.decide(request, list(views.values()), explain=explain)
        if lead and decision.action != "route":
            return None  # a handoff works on the whole prompt
        if block_sizes.get(decision.replica, request.block_size) != request.block_size:
            request = dataclasses.replace(request, block_size=block_sizes[decision.replica])
        route_ms = (time.perf_counter() - started) * 1000.0 + tokenized.cpu_ms
        routed = Routed(request, decision, views, keys_by_block_size, block_sizes, tokenized, routing, route_ms,
                        cache_salt, lookup_ms, whole=not prompt.partial)
        if lead:
            assert tokenized.rest is not None
            routed.completed = asyncio.get_running_loop().create_future()
            ends = [(block_size, keys[-1]) for block_size, keys in keys_by_block_size.items()]
            for end in ends:
                self._lead_ends[end] = self._lead_ends.get(end, 0) + 1
            tokenized.rest.add_done_callback(functools.partial(self._whole, routed, namespace, session_id, ends))
        if not explain:
            routed.deadlines_s = self._attempt_plan(routed, stream)
            m = self.metrics
            m.decisions.labels(decision.action, decision.reason).inc()
            if lead:
                m.routed_on_beginning.inc()
            m.route_seconds.observe(route_ms / 1000.0)
            m.lookup_seconds.observe(lookup_ms / 1000.0)
        return routed

    def _whole(self, routed: Routed, namespace: int, session_id: str | None, ends: list[tuple[int, int]],
               rest: asyncio.Future[TokenizedPrompt]) -> None:
        """A request routed on its prompt's beginning: its ids, keys and count become the whole prompt's, then
        :attr:`Routed.completed` resolves. When the rest failed to tokenize, it keeps its beginning, flagged
        approximate (its count is not compared with the engine's); so it does when the gateway stops first."""
        for end in ends:
            left = self._lead_ends.pop(end, 1) - 1
            if left:
                self._lead_ends[end] = left
        completed = routed.completed
        assert completed is not None and routed.tokenized is not None
        if rest.cancelled():  # the gateway is stopping: what stands is the beginning, not counted as the prompt
            whole = dataclasses.replace(routed.tokenized, approximate=True, source="approximate", rest=None)
        else:
            whole = rest.result()
        if not whole.approximate:
            routed.keys_by_block_size = {
                block_size: self.recent_keys.keys(namespace, whole.token_ids, block_size, session_id)
                for block_size in routed.keys_by_block_size
            }
            routed.request = dataclasses.replace(routed.request, prompt_tokens=len(whole.token_ids))
        routed.tokenized = whole
        completed.set_result(None)

    def _attempt_plan(self, routed: Routed, stream: bool) -> dict[str, float]:
        """The replicas attempts may go to (the ranked ones, as many as ``proxy.max_attempts`` allows), each with its
        first-byte deadline (:func:`~kvgate.router.upstream.proxy.first_byte_deadline_s`)."""
        config = self.proxy
        decision = routed.decision
        ranked = decision.ranked or [decision.replica]
        max_tokens = routed.request.max_tokens
        return {name: first_byte_deadline_s(config, routed.predicted_ttft_ms(name), stream, max_tokens)
                for name in ranked[: config.max_attempts]}

    def route_least_loaded(self, model: str, admission: Admission, among: list[str] | None = None) -> Routed:
        """Requests with no prompt prefix to match (embeddings): the least-loaded replica of those that may serve the
        model (of ``among`` when given); no deadline but the cap."""
        if admission.trace is not None:
            admission.trace.stage("route")
        with routing_errors():
            started = time.perf_counter()
            request, decision, views = self._least_loaded(model, admission, among)
            route_ms = (time.perf_counter() - started) * 1000.0
        return Routed(request, decision, views, {}, {}, None, None, route_ms)

    def route_counted(self, prompt: Prompt, admission: Admission) -> Routed:
        """A prompt only counted, never run (``count_tokens``): the least-loaded of its replicas, its tokens kept
        for the parity check, nothing predicted."""
        if admission.trace is not None:
            admission.trace.stage("route")
        with routing_errors():
            started = time.perf_counter()
            request, decision, views = self._least_loaded(prompt.model, admission, prompt.candidates)
            route_ms = (time.perf_counter() - started) * 1000.0 + prompt.tokenized.cpu_ms
        return Routed(request, decision, views, {}, {}, prompt.tokenized, prompt.routing, route_ms, prompt.cache_salt,
                      whole=not prompt.partial, prefills=False)

    def _least_loaded(
        self, model: str, admission: Admission, among: list[str] | None
    ) -> tuple[RouteRequest, Decision, dict[str, ReplicaView]]:
        names = among if among is not None else self.catalog.candidates(model)
        if not self.catalog.takes_requests(names):
            raise NoHealthyReplica(model)
        views = {name: self.catalog.fleet.view(name, PrefixMatch()) for name in names}
        request = RouteRequest(request_id=admission.request_id, model=model, prompt_tokens=0, block_size=1,
                               tenant=admission.tenant)
        return request, self._least_loaded_policy.decide(request, list(views.values())), views


def settled(
    keys: Sequence[int], found: dict[str, PrefixMatch], block_size: int, lead_ends: Mapping[tuple[int, int], int]
) -> bool:
    """Whether a prompt beginning's ``keys`` (its full blocks, all reusable: the whole prompt is longer) and the
    index's matches of them, ``found``, settle every replica's match of the whole prompt: each ends inside the
    beginning (a replica's walk stops at its first block held in no tier and not predicted, so the rest cannot
    lengthen it), and not at the end of another beginning in ``lead_ends`` ((block size, last key) of prompts routed
    on their beginning and still being tokenized: theirs are predicted whole once they are)."""
    if not keys:
        return False
    whole = len(keys) * block_size
    return not any(
        match.total >= whole or (block_size, keys[match.total // block_size - 1]) in lead_ends
        for match in found.values()
    )
