"""Each replica's KV block size, as its engine reports it.

A prompt must be cut into the blocks the engine hashed, or none of its keys can match: a replica caching 32-token
blocks never holds a key computed over 16 tokens, and routing goes cache-blind without a word. So the router keys a
request with the block size of each replica it compares, taken from, most authoritative first:

1. the ``block_size`` of the replica's ``BlockStored`` events (what the index's keys for it were computed with);
2. the engine's scraped ``vllm:cache_config_info{block_size=...}`` (or SGLang's ``sglang:page_size``), known from the
   first scrape on, before any event;
3. the policy file's ``models[].block_size``, a default until the engine says otherwise.

A block size the policy file states explicitly and the engine contradicts is logged once per replica and value and
exported as ``kvgate_block_size_mismatch{replica}`` (1 while they differ; ``kvgate_replica_block_size`` shows the size
in use); the engine's value is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvgate.router.core.config import ModelConfig

log = logging.getLogger(__name__)


class BlockSizes:
    """Resolves a replica's block size from its events, its scraped metrics and the policy file, in that order."""

    def __init__(self, from_events: Callable[[str], int | None], from_scrape: Callable[[str], int | None]) -> None:
        self._from_events = from_events
        self._from_scrape = from_scrape
        self._stated: dict[str, int] = {}
        """Per replica: the block size its model's policy-file entry states explicitly (not a default)."""
        self._in_use: dict[str, int] = {}
        self._logged: set[tuple[str, int, int]] = set()

    def of(self, name: str, model: ModelConfig | None) -> int:
        """The block size to key ``name``'s lookups with."""
        configured = model.block_size if model is not None else ModelConfig.model_fields["block_size"].default
        learned = self._from_events(name) or self._from_scrape(name)
        if model is not None and "block_size" in model.model_fields_set:
            self._stated[name] = configured
        else:  # not stated (or no longer, after a reload): a default contradicts nothing
            self._stated.pop(name, None)
        size = learned or configured
        if self._in_use.get(name) != size:
            self._in_use[name] = size
            stated = self._stated.get(name)
            if learned is not None and stated is not None and learned != stated \
                    and (name, stated, learned) not in self._logged:
                self._logged.add((name, stated, learned))
                log.warning(
                    "replica %s: the policy file says block_size %d, the engine uses %d; keying its lookups with %d",
                    name, stated, learned, learned,
                )
        return size

    def forget(self, name: str) -> None:
        """The replica left the fleet."""
        self._stated.pop(name, None)
        self._in_use.pop(name, None)

    def stats(self) -> dict[str, dict[str, int]]:
        """For metrics: the block size each replica's lookups use, and 1 where it contradicts the policy file."""
        return {
            "block_size": dict(self._in_use),
            "mismatch": {
                name: int(name in self._stated and size != self._stated[name]) for name, size in self._in_use.items()
            },
        }
