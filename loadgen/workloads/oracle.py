"""The best hit ratio any router could reach on a workload: an infinite prefix cache shared by the whole fleet.

A token counts as a hit when its whole block prefix (block size 16, full blocks only, as vLLM caches) appeared in an
earlier request anywhere. Chains are interned exactly (parent node, block tokens) → node, so there are no collisions.
"""

from __future__ import annotations

from collections.abc import Sequence

ORACLE_BLOCK_SIZE = 16


class PrefixOracle:
    def __init__(self, block_size: int = ORACLE_BLOCK_SIZE):
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def observe(self, ids: Sequence[int]) -> int:
        """Record one prompt; return how many of its leading tokens an infinite shared cache would already hold."""
        bs = self.block_size
        parent = -1
        hit = 0
        matching = True
        for start in range(0, len(ids) - bs + 1, bs):
            key = (parent, tuple(ids[start : start + bs]))
            node = self._nodes.get(key)
            if node is None:
                matching = False
                node = self._nodes[key] = len(self._nodes)
            elif matching:
                hit += bs
            parent = node
        return hit
