"""The policies' frozen picture of each candidate replica (:class:`~kvgate.policies.base.ReplicaView`), filled in with
what the prefix index knows: the prompt's match there (cut by what the replica will evict before it gets to the
request), and its cache's capacity, holdings and value at the margin."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView
from kvgate.router.fleet.state import Fleet
from kvgate.router.routing.model_state import ModelRouting


class ReplicaViews:
    def __init__(self, fleet: Fleet, index: PrefixIndex) -> None:
        self.fleet = fleet
        self.index = index

    def view(self, name: str, match: PrefixMatch, routing: ModelRouting, *, session_match: bool = False) -> ReplicaView:
        """``name``'s view with ``match``, its cache's capacity (scraped), holdings (the index's) and margin filled
        in, for the cost of what a request's new blocks evict there."""
        view = self.fleet.view(name, match, session_match=session_match)
        replica = self.fleet.replicas.get(name)
        scraped = None if replica is None else self.fleet.fresh_scrape(replica)
        if scraped is not None and scraped.num_gpu_blocks and scraped.block_size:
            view.kv_capacity_tokens = scraped.num_gpu_blocks * scraped.block_size
            view.kv_held_tokens = self.index.held_blocks(name) * routing.config.block_size
        view.cache_margin = routing.margins.get(name)
        return view

    def surviving_match(self, name: str, keys: Sequence[int], match: PrefixMatch, block_size: int) -> PrefixMatch:
        """``match`` without the blocks the replica will have evicted before it schedules a request sent now.

        vLLM announces an eviction only at the end of the step that made it, so on a full cache the least recently
        used blocks are credited while the requests already on their way (their uncached tokens, still to be
        allocated) evict them. The index cuts the match at its first block within that reach that no lower tier
        holds; the blocks within it that a lower tier holds are credited there, at its load cost."""
        replica = self.fleet.replicas.get(name)
        scraped = None if replica is None else self.fleet.fresh_scrape(replica)
        if replica is None or scraped is None or not scraped.num_gpu_blocks:
            return match
        matched = match.total // block_size
        incoming = -(-replica.in_flight_prefill_tokens // block_size)
        kept = self.index.surviving_blocks(name, keys[:matched], scraped.num_gpu_blocks, incoming)
        if kept.blocks == matched and not kept.cpu_blocks and not kept.storage_blocks:
            return match
        if not kept.blocks:
            return PrefixMatch()
        survived = self.index.lookup(keys[: kept.blocks], block_size).get(name) or PrefixMatch()
        demoted = (kept.cpu_blocks + kept.storage_blocks) * block_size
        return PrefixMatch(gpu=max(survived.gpu - demoted, 0), cpu=survived.cpu + kept.cpu_blocks * block_size,
                           storage=survived.storage + kept.storage_blocks * block_size, predicted=survived.predicted)
