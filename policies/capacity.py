"""What a new copy displaces: the value of a replica's cache at the margin, and the prefill its evictions will cost.

Engines evict least-recently-used blocks when a request needs room (vLLM's free-block queue, SGLang's radix-tree
LRU). Recomputing a 10k-token document on a replica whose cache is full stores 10k tokens there and evicts 10k
tokens of something else; whoever asks for that next recomputes it. The request's own TTFT does not show the cost,
the fleet's does. This module prices it.

The model is the characteristic-time (Che) approximation of an LRU cache: a block survives ``T`` seconds without a
hit before it is evicted, and a prefix asked for at ``λ`` per second stays cached with probability ``1 − e^{−λT}``.
Giving up one token of cache for a residence time ``T`` loses, at the margin,
``T · Σ sλ²e^{−λT} / Σ sλe^{−λT}`` reuses per token (``s`` = a prefix's tokens): the rate-weighted reuse of the
prefixes whose survival hinges on the cache's size — hot prefixes far from eviction and cold ones that die anyway
weigh little. Each reuse lost costs recomputing the token; at most one recompute per evicted token (after a miss
the prefix is cached again), so the value per token is ``per_token_ms × min(1, that)``.

``T`` is measured, not assumed: the age of the least recently used prefix a replica still holds (its holdings are
the prefix index's, confirmed by the engine's own events; the recency and rates are the router's hot-prefix
tracker's). Until a replica is full, evicting costs nothing and :func:`eviction_ms` is zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.policies.base import CacheMargin, ReplicaView


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """A prefix one replica holds, as the router last saw it requested."""

    tokens: int
    rate_per_s: float
    """Decayed request rate of the prefix over the whole fleet."""
    last_used_s: float
    """When it was last requested (the router's monotonic clock)."""
    holders: int
    """Replicas holding it (its traffic spreads over them)."""


def cache_margin(held: Iterable[HeldPrefix], per_token_ms: float, now: float) -> CacheMargin | None:
    """The margin of a replica holding ``held`` at ``now`` (None when it holds no tracked prefix: nothing known to
    lose). Each prefix's rate is shared among its holders, as the traffic that asks for it is."""
    prefixes = [h for h in held if h.tokens > 0]
    if not prefixes:
        return None
    residence = max(now - min(h.last_used_s for h in prefixes), 0.0)
    weight = weighted = 0.0
    for h in prefixes:
        rate = h.rate_per_s / max(h.holders, 1)
        w = h.tokens * rate * math.exp(-rate * residence)
        weight += w
        weighted += w * rate
    reuses = residence * weighted / weight if weight > 0 else 0.0
    return CacheMargin(per_token_ms * min(1.0, reuses), residence, reuses)


def free_tokens(view: ReplicaView) -> int | None:
    """Room left in the replica's GPU cache before it must evict: its capacity less what the index says it holds
    and the uncached prompt tokens still being prefilled there (about to be stored). None when either is unknown."""
    if view.kv_capacity_tokens is None or view.kv_held_tokens is None:
        return None
    return view.kv_capacity_tokens - view.kv_held_tokens - view.in_flight_prefill_tokens


def eviction_ms(view: ReplicaView, new_tokens: int) -> float:
    """Expected prefill the fleet will lose to the evictions that storing ``new_tokens`` more tokens causes on
    ``view``'s replica: zero while they fit in its free room, then the tokens beyond it times the cache's value at
    the margin (zero when either is unknown)."""
    free = free_tokens(view)
    if free is None or view.cache_margin is None:
        return 0.0
    evicted = new_tokens - max(free, 0)
    return evicted * view.cache_margin.ms_per_token if evicted > 0 else 0.0


def copy_eviction_ms(view: ReplicaView, new_tokens: int, least_tokens: int) -> float:
    """What storing ``new_tokens`` on ``view``'s replica evicts beyond what storing ``least_tokens`` there would: the
    price of a copy, when ``least_tokens`` is the fewest new tokens any replica the request could go to must store
    (a cold prompt's, a warm holder's uncached suffix). Those the fleet stores wherever the request goes, so they
    are not priced: doing so would send new work to the replica whose cache is worth least at the margin, which is
    the one churning fastest, the busiest."""
    if new_tokens <= least_tokens:
        return 0.0
    return eviction_ms(view, new_tokens) - eviction_ms(view, least_tokens)
