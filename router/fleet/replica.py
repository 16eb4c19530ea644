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
        self.scrape_epoch = 0
        """Counts the scrapes asked for: a load ticket remembers the epoch it was dispatched in."""
        self.epoch_at_scrape = 0
        """The epoch the newest scrape began: the engine's numbers in it cannot count requests dispatched in it or
        later."""
        self.prefilling_by_epoch: dict[int, int] = {}
        """This router's requests still prefilling here, by the epoch they were dispatched in (the load tickets keep
        it)."""
        self.completed = 0
        """Requests this router dispatched here that are over (the load tickets count them): what the engine's
        finished counter includes of this router's."""
        self._completed_at_scrape = 0
        self.completions = DecayedRate(ARRIVAL_RATE_HALF_LIFE_S, unbiased=True)
        """This router's completions here lately, counted at each scrape as the engine's finishes are: both rates
        cover the same instants, and both trail arrivals by what is in flight (:mod:`kvgate.router.fleet.blindness`).
        """
        self.engine_finishes = DecayedRate(ARRIVAL_RATE_HALF_LIFE_S, unbiased=True)
        """Requests the engine finished lately, whoever sent them (its scraped counter, differenced)."""
        self.progressed_at = float("-inf")
        """Monotonic time the replica last showed it is working: a first output or a served request of this router's,
        or its engine's finished counter moving at a scrape (anyone's requests). A request waiting there past its
        first-byte deadline is left waiting while this moves (:func:`kvgate.router.upstream.proxy.while_working`)."""
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

    def begin_scrape(self) -> int:
        """A scrape is being asked for: the epoch it begins, for :meth:`record_scrape`."""
        self.scrape_epoch += 1
        return self.scrape_epoch

    def record_scrape(self, load: ScrapedLoad, epoch: int) -> bool:
        """Keep the newest scrape (begun in ``epoch``); count the requests the engine finished since the previous
        one, and this router's own completed meanwhile. A counter that went down means the engine restarted: that
        interval counts nothing. True when the engine's process start time moved since the last scrape that had one
        (the engine restarted)."""
        previous = self.scraped
        self.scraped = load
        self.epoch_at_scrape = epoch
        completed, self._completed_at_scrape = self.completed - self._completed_at_scrape, self.completed
        if previous is not None and previous.finished is not None and load.finished is not None:
            finished = load.finished - previous.finished
            if finished >= 0:
                if finished:
                    self.engine_finishes.add(load.at, finished)
                    self.progressed_at = max(self.progressed_at, load.at)
                if completed:
                    self.completions.add(load.at, completed)
        if load.started_at is None:
            return False
        restarted = self.engine_started_at is not None and load.started_at != self.engine_started_at
        self.engine_started_at = load.started_at
        return restarted

    def prefilling_bound(self, scraped: ScrapedLoad | None) -> int | None:
        """The most of this router's requests that can still be prefilling here: what the engine held in ``scraped``
        (waiting and running, every caller's) plus the router's own still prefilling that were dispatched once it
        was asked for. The router's own count can be higher: it holds a request as prefilling until its first byte
        is read, which for an answer read whole comes after its decode, and on a busy event loop after the engine
        is long done. None without the engine's counts."""
        if scraped is None or scraped.waiting is None or scraped.running is None:
            return None
        since = self.epoch_at_scrape
        later = sum(count for epoch, count in self.prefilling_by_epoch.items() if epoch >= since)
        return scraped.waiting + scraped.running + later

    def can_source(self) -> bool:
        """Can serve a transfer's prefill-only first leg: the engine passes health checks and real requests are not
        failing (breaker closed). Draining does not matter: no new requests, but its cache is still there."""
        return self.healthy and self.breaker.state == "closed"

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, healthy={self.healthy}, draining={self.draining}, in_flight={self.in_flight})"
