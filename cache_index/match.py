"""What a lookup answers: how many leading prompt tokens one replica holds, per tier."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.IntEnum):
    """Where a block's KV lives on a replica; lower is faster to use."""

    GPU = 0
    CPU = 1
    STORAGE = 2


MEDIUM_TIERS: dict[str, Tier] = {
    # vLLM (None and "GPU" before/after 0.10.2; offloading connectors publish CPU / STORAGE)
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.STORAGE,
    "DISK": Tier.STORAGE,
    # SGLang 0.5.23 media
    "CPU_PINNED": Tier.CPU,
    "EXTERNAL": Tier.STORAGE,
}


def tier_of_medium(medium: str | None) -> Tier | None:
    """Map an event's ``medium`` to a tier; ``None`` (pre-0.10.2 engines) means GPU; unknown media are not trusted."""
    if medium is None:
        return Tier.GPU
    return MEDIUM_TIERS.get(medium.upper())


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt an engine can take from its prefix cache.

    vLLM looks up at most ``prompt_tokens - 1`` tokens (the last one is always computed, for its logits), so a prompt
    that ends exactly on a block boundary reuses one block less than it holds: 3,008 tokens in 32-token blocks hold
    94 blocks and reuse 93 (2,976 tokens). Anything crediting a match must credit at most this many blocks.
    """
    return max(prompt_tokens - 1, 0) // block_size


@dataclass(slots=True)
class PrefixMatch:
    """Leading prompt tokens one replica holds, attributed per block to the best tier that holds it.

    The walk goes block by block from position 0 and stops at the first block the replica holds in no tier, so
    ``gpu + cpu + storage + predicted`` is the replica's longest contiguous cached prefix. ``predicted`` counts blocks
    known only from the router's own recent routing (not yet confirmed by a ``BlockStored`` event).
    """

    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    predicted: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.storage + self.predicted

    def as_dict(self) -> dict[str, int]:
        return {"gpu": self.gpu, "cpu": self.cpu, "storage": self.storage, "predicted": self.predicted}
