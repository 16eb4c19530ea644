"""One engine replica and everything the gateway knows about it: health, breaker, load, scraped numbers."""

from __future__ import annotations

from typing import Any

from kvgate.policies.rate import DecayedRate
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.upstream.breaker import CircuitBreaker
from kvgate.router.upstream.health import HealthState
from kvgate.router.upstream.scrape import ScrapedLoad

ARRIVAL_RATE_HALF_LIFE_S = 10.0
"""Memory of each replica's arrival rate: long enough to average a few dozen requests at a few per second, short
enough to follow traffic that moved within a minute."""


class Replica:
    """One engine replica and everything the router knows about it."""

    def __init__(self, config: ReplicaConfig, breaker: CircuitBreaker) -> None:
        self.config = config
        self.breaker = breaker
        self.healthy = False
        self.draining = False
        self.in_flight = 0
        self.in_flight_prefill_tokens = 0
        self.in_flight_prefilling = 0
        self.arrivals = DecayedRate(ARRIVAL_RATE_HALF_LIFE_S, unbiased=True)
        """Requests the router dispatched here lately (every attempt, warm-ups and transfer legs included)."""
        self.engine_finishes = DecayedRate(ARRIVAL_RATE_HALF_LIFE_S, unbiased=True)
        """Requests the engine finished lately, whoever sent them (its scraped counter, differenced)."""
        self.scraped: ScrapedLoad | None = None
        self.engine_started_at: float | None = None
        """The engine process's start time as last scraped (None if it does not export one)."""
        self.recovery_scrapes = 0
        """Health probes pass again after an outage, and this many recovery scrapes found no /metrics answer: the
        replica takes requests once one answers (or after ``RECOVERY_SCRAPES`` tries)."""
        self.served_models: list[dict[str, Any]] = []
        self.generation = 0
        self.health = HealthState()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    def routable(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allow()

    def arrival_rate_per_s(self, now: float, peers_per_s: float = 0.0) -> float:
        """Requests per second arriving here: this router's own dispatches plus what its peer gateways report sending
        (``peers_per_s``), or the engine's finish rate when that is higher (direct callers send it work too; in a
        steady state finishes match arrivals). The finish rate alone is no substitute for the peers' reports: it
        trails arrivals while a queue builds, and by a scrape interval always."""
        return max(self.arrivals.per_s(now) + peers_per_s, self.engine_finishes.per_s(now))

    def record_scrape(self, load: ScrapedLoad) -> bool:
        """Keep the newest scrape; count the requests the engine finished since the previous one. A counter that went
        down means the engine restarted: that interval counts nothing. True when the engine's process start time
        moved since the last scrape that had one (the engine restarted)."""
        previous = self.scraped
        self.scraped = load
        if previous is not None and previous.finished is not None and load.finished is not None:
            finished = load.finished - previous.finished
            if finished > 0:
                self.engine_finishes.add(load.at, finished)
        if load.started_at is None:
            return False
        restarted = self.engine_started_at is not None and load.started_at != self.engine_started_at
        self.engine_started_at = load.started_at
        return restarted

    def can_source(self) -> bool:
        """Can serve a transfer's prefill-only first leg: the engine passes health checks and real requests are not
        failing (breaker closed). Draining does not matter: no new requests, but its cache is still there."""
        return self.healthy and self.breaker.state == "closed"

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, healthy={self.healthy}, draining={self.draining}, in_flight={self.in_flight})"
