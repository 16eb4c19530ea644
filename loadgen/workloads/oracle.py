"""The best any router could do on a workload: the hit ratio of an infinite prefix cache shared by the whole fleet,
and the TTFT of prefilling only what that cache lacks, never queued (:class:`IdealPrefill`).

A token counts as a hit when its whole block prefix (block size 16, full blocks only, as vLLM caches) appeared in an
earlier request anywhere. Chains are interned exactly (parent node, block tokens) → node, so there are no collisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.loadgen.sim.params import SimParams

ORACLE_BLOCK_SIZE = 16
_SIM_DEFAULTS = SimParams(model="")


class PrefixOracle:
    def __init__(self, block_size: int = ORACLE_BLOCK_SIZE):
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def observe(self, ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """Record one prompt; return how many of its leading tokens an infinite shared cache would already hold, and
        its chain: one node id per full block, naming the block and everything before it (so two prompts share a
        node exactly when they share the prefix up to and including that block)."""
        bs = self.block_size
        parent = -1
        hit = 0
        matching = True
        chain: list[int] = []
        for start in range(0, len(ids) - bs + 1, bs):
            key = (parent, tuple(ids[start : start + bs]))
            node = self._nodes.get(key)
            if node is None:
                matching = False
                node = self._nodes[key] = len(self._nodes)
            elif matching:
                hit += bs
            chain.append(node)
            parent = node
        return hit, tuple(chain)


@dataclass(frozen=True, slots=True)
class IdealPrefill:
    """The TTFT of an ideal router: every request's truly new tokens (beyond what the infinite shared cache above
    holds) prefilled at once on an idle engine, with no queueing, priced with the simulated engine's own time model.
    That is the floor the routers are measured against: no routing decision can beat it, because the cache is
    infinite, shared and never waited for.

    Parameters default to ``kvgate sim``'s (:class:`loadgen.sim.params.SimParams`): each engine step costs
    ``step_overhead_ms``, prefill ``prefill_ms_per_token`` per token and ``request_overhead_ms`` once per request;
    a prompt longer than ``token_budget`` is prefilled in several steps. The engine always computes the last prompt
    token, so at most ``prompt - 1`` tokens (in whole blocks) are hits.
    """

    step_overhead_ms: float = _SIM_DEFAULTS.step_overhead_ms
    prefill_ms_per_token: float = _SIM_DEFAULTS.prefill_ms_per_token
    request_overhead_ms: float = _SIM_DEFAULTS.request_overhead_ms
    token_budget: int = _SIM_DEFAULTS.token_budget
    block_size: int = ORACLE_BLOCK_SIZE

    def ttft_ms(self, prompt_tokens: int, hit_tokens: int) -> float:
        usable = ((max(prompt_tokens - 1, 0)) // self.block_size) * self.block_size
        new = max(prompt_tokens - min(hit_tokens, usable), 1)
        steps = math.ceil(new / self.token_budget)
        return steps * self.step_overhead_ms + self.prefill_ms_per_token * new + self.request_overhead_ms
