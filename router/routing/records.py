"""What the tokenize and route stages hand on: a tokenized :class:`Prompt`, then a decided :class:`Routed` request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.policies.base import Decision, ReplicaView, RouteRequest
from kvgate.policies.cost_model import need_tokens
from kvgate.router.prompts.tokenizer import TokenizedPrompt
from kvgate.router.routing.model_state import ModelRouting


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
    partial: bool = False
    """The token ids are not all the engine runs (a stored response's follow-up whose history kvgate does not have):
    nothing is looked up or predicted from them, and their count is not the engine's."""


@dataclass(slots=True)
class Routed:
    """A decided request: everything forwarding, accounting and explain need afterwards. A request routed without a
    prompt (embeddings: least loaded) has no tokens, views, keys or model state."""

    request: RouteRequest
    decision: Decision
    views: dict[str, ReplicaView]
    keys_by_block_size: dict[int, Sequence[int]]
    """The prompt's block keys (every full block) for each block size the candidate replicas use."""
    block_sizes: dict[str, int]
    """Each candidate replica's block size."""
    tokenized: TokenizedPrompt | None
    routing: ModelRouting | None
    route_ms: float
    cache_salt: str | None = None
    lookup_ms: float = 0.0
    """The prefix-index lookup alone (part of ``route_ms``)."""
    deadlines_s: dict[str, float] = field(default_factory=dict)
    """Each replica an attempt may be sent to, in ranked order, and its first-byte deadline (the proxy's plan)."""
    whole: bool = True
    """Whether the token ids are the whole prompt the engine runs (not :attr:`Prompt.partial`): only then are its
    blocks predicted where it goes, and its counts compared with the engine's."""
    prefills: bool = True
    """Whether the engine prefills the prompt (counting its tokens does not): only then are its blocks predicted."""
    completed: asyncio.Future[None] | None = None
    """For a request routed on its prompt's beginning
    (:meth:`~kvgate.router.pipeline.route.RouteStage.route_lead`), done once its ``tokenized``, ``keys_by_block_size``
    and ``request.prompt_tokens`` are the whole prompt's: what uses them after the dispatch (predictions, accounting)
    waits for it. None: they are already."""

    def keys_for(self, replica: str) -> Sequence[int]:
        """The prompt's block keys as ``replica`` hashes them (its block size)."""
        size = self.block_sizes.get(replica, self.request.block_size)
        return self.keys_by_block_size.get(size, ())

    @property
    def keys(self) -> Sequence[int]:
        """The prompt's block keys as the chosen replica hashes them."""
        return self.keys_for(self.decision.replica)

    def matched_tokens(self, replica: str) -> int:
        view = self.views.get(replica)
        return min(view.match.total, self.request.prompt_tokens) if view is not None else 0

    def prefill_tokens(self, replica: str) -> int:
        """Uncached prompt tokens the replica must compute (the load a dispatch adds)."""
        return max(0, self.request.prompt_tokens - self.matched_tokens(replica))

    def queue_delay_ms(self, replica: str) -> float:
        """The cost model's wait before this request's prefill on ``replica``: the work ahead there and, on a full
        cache, the wait for KV of this request's size (:meth:`~kvgate.policies.cost_model.CostModel.kv_wait_ms`)."""
        view = self.views.get(replica)
        if view is None or self.routing is None:
            return 0.0
        model = self.routing.cost_model
        kv_wait = model.kv_wait_ms(view, need_tokens(self.prefill_tokens(replica), self.request.max_tokens))
        return model.queue_delay_ms(view) + model.prefill.queue_scale * kv_wait

    def predicted_ttft_ms(self, replica: str) -> float | None:
        """The cost model's TTFT for this request on ``replica`` (queue delay included), as the fleet looked when
        the request was routed: the policy's own when it priced the replica; None for a replica that was not a
        candidate, or a request routed without a prompt."""
        priced = self.decision.ttft_ms
        if priced is not None and replica in priced:
            return priced[replica]
        view = self.views.get(replica)
        if view is None or self.routing is None:
            return None
        return self.routing.cost_model.estimate(self.request, view).ttft_ms
