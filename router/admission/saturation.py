"""Whether any replica of a model could start a new request soon: the signal the gateway queues on.

From what the gateway already sees of each candidate: the cost model's queue delay there (prefills in flight from
this gateway and its peers, the engine's own waiting queue beyond them, decode interference), the engine's KV usage,
and whether its scraped load is still fresh. A replica whose scraped load went stale counts as unable to start
(fail closed: its engine may be drowning); one never scraped yet is judged on the gateway's own counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvgate.cache_index.match import PrefixMatch
from kvgate.router.admission.config import AdmissionConfig
from kvgate.router.fleet.state import Fleet
from kvgate.router.routing.model_state import ModelRouting


@dataclass(frozen=True, slots=True)
class Capacity:
    """The soonest any candidate could start a request, and which one (None: none can)."""

    start_delay_ms: float
    replica: str | None

    def saturated(self, config: AdmissionConfig) -> bool:
        return self.replica is None or self.start_delay_ms > config.max_start_delay_ms


class Saturation:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def capacity(self, candidates: list[str], routing: ModelRouting, config: AdmissionConfig) -> Capacity:
        """The soonest start among ``candidates`` (for explain and metrics)."""
        best, soonest = None, math.inf
        for name, delay in self._start_delays(candidates, routing, config):
            if delay < soonest:
                best, soonest = name, delay
        return Capacity(soonest, best)

    def can_start(self, candidates: list[str], routing: ModelRouting, config: AdmissionConfig, need: int = 1) -> bool:
        """Whether ``need`` candidates could each start a request within ``max_start_delay_ms`` (stops as soon as
        that many are found)."""
        bound = config.max_start_delay_ms
        found = 0
        for _, delay in self._start_delays(candidates, routing, config):
            if delay <= bound:
                found += 1
                if found >= need:
                    return True
        return False

    def startable(self, candidates: list[str], routing: ModelRouting, config: AdmissionConfig) -> list[str]:
        """The candidates that could start a request within ``max_start_delay_ms``, soonest first."""
        bound = config.max_start_delay_ms
        return [name for delay, name in sorted((delay, name) for name, delay in
                                               self._start_delays(candidates, routing, config) if delay <= bound)]

    def _start_delays(
        self, candidates: list[str], routing: ModelRouting, config: AdmissionConfig,
    ) -> Iterator[tuple[str, float]]:
        fleet = self.fleet
        now = fleet.clock()
        for name in candidates:
            replica = fleet.replicas.get(name)
            if replica is None or not replica.routable() or replica.config.role == "prefill":
                continue
            if replica.scraped is not None:
                scraped = fleet.fresh_scrape(replica, now)
                if scraped is None:
                    continue  # stale: fail closed
                if scraped.kv_usage is not None and scraped.kv_usage > config.max_kv_usage:
                    continue
            yield name, routing.cost_model.queue_delay_ms(fleet.view(name, PrefixMatch()))
