"""The parity monitor: every answer carries the engine's own counts, and kvgate checks its own against them, per
request, per model and API.

Two things are compared. The **prompt's token count**: when kvgate tokenized a prompt itself (its own copy of the
model's tokenizer and chat template), its count must equal the engine's ``prompt_tokens``; any difference means its
token ids differ from the engine's, so its block keys do too, and it routes blind to the cache without knowing it.
And the **cached tokens**: what kvgate credited the replica with (the prefix index's match) against what the engine
reused. Crediting more than was reused is the costly error, a request sent to a replica for a cache that was not
there; reused but not credited is a missed chance.

A model whose prompt counts keep disagreeing (``parity.untrust_after`` mismatches among its last ``parity.window``
exact counts) is no longer trusted: its requests route as approximate ones (matches credited at
``policy.cost.approximate_match_weight``, no KV transfers) and an error is logged. kvgate keeps counting in the
background, and trusts the model again after ``parity.recover_after`` matching counts in a row (a reload that fixed
its template, a model redeployed with the tokenizer kvgate has).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.routing.config import ParityConfig

log = logging.getLogger(__name__)

CACHE_RESULTS = ("match", "credited_not_reused", "reused_not_credited")


@dataclass(frozen=True, slots=True)
class Sample:
    """One answered request's counts: kvgate's and the engine's."""

    model: str
    api: str
    request_id: str
    counted: int | None
    """kvgate's prompt tokens when it tokenized the prompt itself (None: the count is not its own, e.g. approximate)."""
    engine_prompt: int
    credited: int
    """Prompt tokens kvgate credited as cached on the replica that served the request."""
    engine_cached: int | None
    """Prompt tokens the engine reused (None: it does not say)."""
    block_size: int


@dataclass(slots=True)
class ModelParity:
    recent: deque[bool]
    """Whether each of the last exact prompt counts matched."""
    trusted: bool = True
    streak: int = 0
    """Matching counts in a row (what restores trust)."""
    prompt: dict[str, int] = field(default_factory=lambda: {"match": 0, "mismatch": 0})
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_RESULTS, 0))
    last_mismatch: dict[str, Any] | None = None
    logged_at: float = float("-inf")

    def as_dict(self) -> dict[str, Any]:
        return {"trusted": self.trusted, "prompt_tokens": dict(self.prompt), "cached_tokens": dict(self.cached),
                "recent_mismatches": self.recent.count(False), "last_mismatch": self.last_mismatch}


class ParityMonitor:
    def __init__(self, config: ParityConfig, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.models: dict[str, ModelParity] = {}

    def reconfigure(self, config: ParityConfig) -> None:
        self.config = config
        for parity in self.models.values():
            parity.recent = deque(parity.recent, maxlen=config.window)

    def trusted(self, model: str) -> bool:
        parity = self.models.get(model)
        return parity is None or parity.trusted

    def observe(self, sample: Sample) -> None:
        parity = self.models.get(sample.model)
        if parity is None:
            parity = self.models[sample.model] = ModelParity(deque(maxlen=self.config.window))
        if sample.counted is not None:
            self._prompt(parity, sample)
        if sample.engine_cached is not None:
            self._cached(parity, sample)

    def _prompt(self, parity: ModelParity, sample: Sample) -> None:
        assert sample.counted is not None
        match = sample.counted == sample.engine_prompt
        result = "match" if match else "mismatch"
        parity.prompt[result] += 1
        self.metrics.parity_prompt.labels(sample.model, sample.api, result).inc()
        parity.recent.append(match)
        if match:
            parity.streak += 1
        else:
            parity.streak = 0
            parity.last_mismatch = {"request_id": sample.request_id, "api": sample.api, "kvgate_prompt_tokens":
                                    sample.counted, "engine_prompt_tokens": sample.engine_prompt}
            self._warn(parity, sample)
        cfg = self.config
        if parity.trusted and parity.recent.count(False) >= cfg.untrust_after:
            parity.trusted = False
            log.error("model %s: kvgate's prompt token counts disagree with the engine's (%d of the last %d); its "
                      "requests route as approximate until %d counts in a row agree", sample.model,
                      parity.recent.count(False), len(parity.recent), cfg.recover_after,
                      extra={"fields": {"model": sample.model, **(parity.last_mismatch or {})}})
        elif not parity.trusted and parity.streak >= cfg.recover_after:
            parity.trusted = True
            parity.recent.clear()
            log.warning("model %s: kvgate's prompt token counts agree with the engine's again: exact routing resumes",
                        sample.model)

    def _cached(self, parity: ModelParity, sample: Sample) -> None:
        assert sample.engine_cached is not None
        gap = sample.credited - sample.engine_cached
        if abs(gap) < sample.block_size:
            result = "match"
        else:
            result = "credited_not_reused" if gap > 0 else "reused_not_credited"
        parity.cached[result] += 1
        self.metrics.parity_cached.labels(sample.model, sample.api, result).inc()

    def _warn(self, parity: ModelParity, sample: Sample) -> None:
        """One warning per model per ``parity.log_interval_s``, with the counts of the mismatch that caused it."""
        now = self.clock()
        if now - parity.logged_at < self.config.log_interval_s:
            return
        parity.logged_at = now
        log.warning("prompt token count differs from the engine's: model %s api %s request %s: kvgate %d, engine %d",
                    sample.model, sample.api, sample.request_id, sample.counted, sample.engine_prompt,
                    extra={"fields": {"model": sample.model, **(parity.last_mismatch or {})}})

    def state(self) -> dict[str, dict[str, Any]]:
        """Each model's parity, as explain and ``/admin/replicas`` show it."""
        return {model: parity.as_dict() for model, parity in self.models.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        """For metrics: each model seen, 1 when its exact keys are trusted (``kvgate_parity_trusted``)."""
        return {"trusted": {model: float(parity.trusted) for model, parity in self.models.items()}}
