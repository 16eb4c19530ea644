"""Looking inside the prefix index from tests: what the index itself never needs to answer."""

from __future__ import annotations

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.match import Tier


def tiers_of(index: PrefixIndex, replica: str, key: int) -> list[Tier]:
    """Every tier ``replica`` holds ``key`` in (confirmed holdings only)."""
    slot = index._slots.get(replica)
    if slot is None:
        return []
    mask = index._holders.get(key, 0) >> (slot * len(Tier))
    return [tier for tier in Tier if mask >> tier & 1]
