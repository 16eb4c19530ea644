"""The live replica set: who is up, who is draining, and how busy each replica is right now.

Everything here runs on the gateway's one asyncio loop, so state is plain attributes with no locks. Each replica has two
background tasks: an active health probe (``/health`` plus a ``/v1/models`` refresh) and a ``/metrics`` scrape. Load the
gateway causes itself is counted exactly and synchronously: :meth:`Fleet.dispatch` adds a request and its uncached
prompt tokens, the returned :class:`~kvgate.router.fleet.tickets.LoadTicket` removes the prompt tokens at the first
token and the request at the end. Scraped engine numbers add what the router cannot see (requests that bypassed it) and
are ignored once older than ``scrape.stale_after_ms``.

Listeners hear about replicas appearing, disappearing and being reset; a reset means the replica's cached state is in
doubt (it was down and came back), so the prefix index forgets what it knew about it. An engine whose scraped process
start time moved restarted, whether or not its health checks noticed: listeners hear that too (``on_restarted``).
Draining is not a reset: the engine keeps its cache and still publishes its events, and the cost policy may pull
that cache from it by transfer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Callable


from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView
from kvgate.router.fleet.blindness import UNSEEN_SHARE_ON, Blindness, Observation
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.peer_work import PeerWork
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.tickets import NO_WORK, DispatchedWork, LoadTicket
from kvgate.router.upstream.client import EngineClient
from kvgate.router.upstream.breaker import CircuitBreaker
from kvgate.router.upstream.config import BreakerConfig, HealthConfig, ScrapeConfig
from kvgate.router.upstream.health import fetch_models, probe_health
from kvgate.router.upstream.scrape import ScrapedLoad, scrape_metrics

log = logging.getLogger(__name__)

BLINDNESS_EVERY_S = 1.0
"""How often the blindness signal is judged, at most (after a scrape)."""
REPORTED_RATE_MIN_PER_S = 0.01
"""A replica this gateway sends fewer requests a second than this is left out of its work report."""
RECOVERY_SCRAPES = 5
"""Health probes a recovering replica waits for its /metrics to answer with the engine's process start time; after
that it recovers without one, and the index forgets what it learned while the replica was down."""
SCRAPE_TIMEOUT_CAP_S = 1.0
"""A /metrics answer slower than this is useless for 100 ms load tracking."""


class FleetListener:
    """Override what you need; the prefix index subscribes to replicas through these."""

    def on_added(self, replica: Replica) -> None:
        """A replica joined (from the config file, a reload or the admin API)."""

    def on_removed(self, name: str) -> None:
        """A replica left the fleet."""

    def on_reset(self, name: str, reason: str) -> None:
        """The replica's cached state is in doubt (``down``, drained): forget it."""

    def on_recovered(self, name: str, started_at: float | None) -> None:
        """The replica passes health checks again; ``started_at`` is its engine's process start time scraped at that
        moment (None when the engine does not export it): keep only state its current process provably published."""

    def on_restarted(self, name: str, started_at: float) -> None:
        """The replica's engine process restarted at ``started_at`` (seconds since the epoch, the engine's clock):
        it holds nothing it held before then."""


class Fleet:
    """The replicas, from the policy file's ``replicas`` and what discovery and the admin API add, read with the
    ``health``, ``scrape`` and ``breaker`` sections (:meth:`reconfigure` takes reloaded ones)."""

    def __init__(
        self, replicas: Sequence[ReplicaConfig], client: EngineClient, *, health: HealthConfig,
        scrape: ScrapeConfig, breaker: BreakerConfig, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health = health
        self.scrape = scrape
        self.breaker = breaker
        self.client = client
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self.listeners: list[FleetListener] = []
        self.peer_work: PeerWork | None = None
        """What other gateways dispatched to each replica (written by ``peers.hints``), added to this gateway's own
        in its views; None without work sharing."""
        self.blindness = Blindness()
        """Whether the engines finish more than this gateway and its peers send them (:mod:`.blindness`), judged
        after scrapes, at most every ``BLINDNESS_EVERY_S``."""
        self._blindness_judged_at = -math.inf
        self._from_config: set[str] = set()
        """Replicas the policy file owns; admin-added ones survive reloads that do not mention them."""
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._started = False
        for cfg in replicas:
            self._insert(cfg)
            self._from_config.add(cfg.name)

    # lifecycle

    async def start(self) -> None:
        """Announce the file's replicas to the listeners registered so far (``on_added``), probe each once (health,
        models, metrics) so the first request sees real state, then loop. Listeners added after ``start()`` read
        ``replicas`` for what already exists."""
        self._started = True
        initial = list(self.replicas.values())
        for replica in initial:
            self._notify("on_added", replica)
        await asyncio.gather(*(self._first_look(r) for r in initial))
        for replica in initial:
            if self.replicas.get(replica.name) is replica:
                self._spawn_loops(replica)

    async def stop(self) -> None:
        self._started = False
        for name in list(self._tasks):
            self._cancel_loops(name)
        await self._await_cancelled()

    # reading

    def dispatched_work(self) -> dict[str, DispatchedWork]:
        """This gateway's own work per replica it is prefilling on or lately sends requests to."""
        now = self.clock()
        work = {}
        for r in self.replicas.values():
            rate = r.arrivals.per_s(now)
            if r.in_flight_prefilling or rate >= REPORTED_RATE_MIN_PER_S:
                prefilling, tokens = self._own_prefilling(r, self.fresh_scrape(r, now))
                work[r.name] = DispatchedWork(tokens, prefilling, rate)
        return work

    @staticmethod
    def _own_prefilling(replica: Replica, scraped: ScrapedLoad | None) -> tuple[int, int]:
        """This gateway's requests still prefilling on ``replica`` and their uncached tokens, at most
        :meth:`Replica.prefilling_bound` of them (the tokens in proportion)."""
        own, tokens = replica.in_flight_prefilling, replica.in_flight_prefill_tokens
        bound = replica.prefilling_bound(scraped)
        if bound is not None and own > bound:  # the engine is done with some the gateway still counts
            return bound, tokens * bound // own
        return own, tokens

    def arrival_rate_per_s(self, replica: Replica, now: float | None = None) -> float:
        """Requests per second arriving at ``replica`` from every gateway (:meth:`Replica.arrival_rate_per_s`)."""
        peers = NO_WORK if self.peer_work is None else self.peer_work.work(replica.name)
        return replica.arrival_rate_per_s(self.clock() if now is None else now, peers.arrival_rate_per_s)

    def view(self, name: str, match: PrefixMatch, *, session_match: bool = False) -> ReplicaView:
        r = self.replicas[name]
        now = self.clock()
        scraped = self.fresh_scrape(r, now)
        peers = NO_WORK if self.peer_work is None else self.peer_work.work(name)
        own, own_tokens = self._own_prefilling(r, scraped)
        return ReplicaView(
            name=r.name,
            healthy=r.routable(),
            match=match,
            can_source=r.can_source(),
            draining=r.draining,
            in_flight=r.in_flight,
            in_flight_prefill_tokens=own_tokens + peers.prefill_tokens,
            in_flight_prefilling=own + peers.prefilling,
            arrival_rate_per_s=r.arrival_rate_per_s(now, peers.arrival_rate_per_s),
            scraped_waiting=None if scraped is None else scraped.waiting,
            scraped_running=None if scraped is None else scraped.running,
            kv_usage=None if scraped is None else scraped.kv_usage,
            generation=r.generation,
            labels=r.config.labels,
            role=r.config.role,
            engine=r.config.engine,
            last_session_match=session_match,
        )

    def fresh_scrape(self, replica: Replica, now: float | None = None) -> ScrapedLoad | None:
        """The replica's scraped numbers, or None when there are none younger than ``scrape.stale_after_ms``."""
        s = replica.scraped
        if s is None or ((self.clock() if now is None else now) - s.at) * 1000.0 > self.scrape.stale_after_ms:
            return None
        return s

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable()]

    def models(self) -> list[dict[str, Any]]:
        """Union of the healthy replicas' ``/v1/models`` entries, first seen wins per id."""
        seen: dict[str, dict[str, Any]] = {}
        for r in self.replicas.values():
            if r.healthy:
                for m in r.served_models:
                    seen.setdefault(m["id"], m)
        return list(seen.values())

    def base_model_of(self, model: str) -> tuple[str, str | None]:
        """(base model, LoRA name or None). vLLM lists a LoRA adapter as its own model whose ``parent`` is the base."""
        for r in self.replicas.values():
            for m in r.served_models:
                if m["id"] == model:
                    parent = m.get("parent")
                    if isinstance(parent, str) and parent and parent != model:
                        return parent, model
                    return model, None
        return model, None

    # load accounting and passive health

    def dispatch(self, name: str, prefill_tokens: int, caller: str | None = None) -> LoadTicket:
        replica = self.replicas[name]
        replica.arrivals.add(self.clock())
        return LoadTicket(replica, max(0, prefill_tokens), caller)

    def may_eject(self) -> bool:
        """Whether one more replica's circuit may open: at most ``breaker.max_ejected_fraction`` of the fleet (at
        least one replica) is ejected at once, so failures that are really the clients' cannot empty the fleet."""
        ejected = sum(1 for r in self.replicas.values() if r.breaker.state != "closed")
        return ejected < max(1, int(self.breaker.max_ejected_fraction * len(self.replicas)))

    def serving(self) -> list[Replica]:
        """Replicas that pass their health checks and are not draining, whatever their circuits say: what readiness
        is judged on (an open circuit is a transient ejection, and failures a client caused must not unready the
        gateway)."""
        return [r for r in self.replicas.values() if r.healthy and not r.draining]

    # membership

    def add(self, cfg: ReplicaConfig) -> Replica:
        """Add a replica at runtime; it takes traffic once its first health probe passes. ``ValueError`` if the name
        is taken."""
        if cfg.name in self.replicas:
            raise ValueError(f"replica {cfg.name!r} already exists")
        replica = self._insert(cfg)
        if self._started:
            self._spawn_loops(replica, first_look=True)
        return replica

    def drain(self, name: str) -> None:
        """No new requests go to the replica; in-flight ones finish. ``KeyError`` if unknown. What it caches stays
        in the prefix index (its engine still publishes events), so transfers can pull it elsewhere."""
        self.replicas[name].draining = True

    def undrain(self, name: str) -> None:
        """New requests may go to the replica again. ``KeyError`` if unknown."""
        self.replicas[name].draining = False

    async def remove(self, name: str) -> None:
        """Take the replica out now (``KeyError`` if unknown). In-flight requests keep their own connection and
        finish; only the background probes stop."""
        self._detach(name)
        await self._await_cancelled()

    def reconfigure(
        self, replicas: Sequence[ReplicaConfig], *, health: HealthConfig, scrape: ScrapeConfig, breaker: BreakerConfig
    ) -> None:
        """A reloaded policy file: add, remove and update the replicas it owns; intervals and breaker thresholds take
        effect at each loop's next step. A replica whose endpoints changed is replaced (its cached state is another
        engine's). The file is the source of truth for its replicas: one removed through the admin API but still
        listed comes back."""
        old = {name: self.replicas[name].config for name in self._from_config if name in self.replicas}
        new = {cfg.name: cfg for cfg in replicas}
        self.health, self.scrape, self.breaker = health, scrape, breaker
        for r in self.replicas.values():
            r.breaker.config = breaker
        for name in old.keys() - new.keys():
            self._detach(name)
        for name, cfg in new.items():
            current = self.replicas.get(name)
            if current is None:
                self.add(cfg)
            elif _same_engine(current.config, cfg):
                current.config = cfg
            else:
                self._detach(name)
                self.add(cfg)
        self._from_config = set(new)

    # internals

    def _insert(self, cfg: ReplicaConfig) -> Replica:
        replica = Replica(cfg, CircuitBreaker(self.breaker, self.clock, self.may_eject))
        self.replicas[cfg.name] = replica
        if self._started:
            self._notify("on_added", replica)
        return replica

    def _detach(self, name: str) -> None:
        del self.replicas[name]
        self._from_config.discard(name)
        self._cancel_loops(name)
        if self._started:
            self._notify("on_removed", name)

    def _spawn_loops(self, replica: Replica, first_look: bool = False) -> None:
        self._tasks[replica.name] = [
            asyncio.create_task(self._health_loop(replica, first_look), name=f"health:{replica.name}"),
            asyncio.create_task(self._scrape_loop(replica), name=f"scrape:{replica.name}"),
        ]

    def _cancel_loops(self, name: str) -> None:
        for task in self._tasks.pop(name, []):
            task.cancel()
            self._stopping.add(task)

    async def _await_cancelled(self) -> None:
        tasks, self._stopping = self._stopping, set()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _first_look(self, replica: Replica) -> None:
        await asyncio.gather(self._check_health(replica), self._scrape(replica))

    async def _health_loop(self, replica: Replica, first_look: bool) -> None:
        if first_look:
            await self._first_look(replica)
        while True:
            await asyncio.sleep(self.health.interval_s)
            try:
                await self._check_health(replica)
            except Exception:  # a bug in one probe must not end the loop for good
                log.exception("health check of %s failed unexpectedly", replica.name)

    async def _scrape_loop(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.scrape.interval_ms / 1000.0)
            if replica.healthy:
                try:
                    await self._scrape(replica)
                except Exception:  # same: keep scraping after an unexpected error
                    log.exception("scrape of %s failed unexpectedly", replica.name)

    async def _scrape(self, replica: Replica) -> ScrapedLoad | None:
        timeout = min(SCRAPE_TIMEOUT_CAP_S, self.scrape.stale_after_ms / 2000.0)
        epoch = replica.begin_scrape()
        load = await scrape_metrics(self.client, replica.url, timeout, self.clock)
        if load is not None and replica.record_scrape(load, epoch) and self.replicas.get(replica.name) is replica:
            log.warning("replica %s restarted (process start time moved to %.3f)", replica.name, load.started_at)
            self._notify("on_restarted", replica.name, load.started_at)
        now = self.clock()
        if now - self._blindness_judged_at >= BLINDNESS_EVERY_S:
            self._blindness_judged_at = now
            self.judge_blindness(now)
        return load

    def finishes_and_seen_per_s(self, replica: Replica, now: float) -> tuple[float, float]:
        """Requests per second ``replica``'s engine finished (every caller's), and what of that this gateway knows:
        its own completed there plus its peers' reported dispatches."""
        peers = NO_WORK if self.peer_work is None else self.peer_work.work(replica.name)
        return replica.engine_finishes.per_s(now), replica.completions.per_s(now) + peers.arrival_rate_per_s

    def unseen_rate_per_s(self, replica: Replica, now: float | None = None) -> float:
        """Requests per second ``replica``'s engine finished beyond what this gateway completed there and its peers
        report sending (0 when everything is accounted for)."""
        finished, seen = self.finishes_and_seen_per_s(replica, self.clock() if now is None else now)
        return max(0.0, finished - seen)

    def unseen_rates(self) -> list[tuple[str, float]]:
        now = self.clock()
        return [(r.name, self.unseen_rate_per_s(r, now)) for r in self.replicas.values()]

    def judge_blindness(self, now: float) -> None:
        """Feed the blindness signal the fleet's summed rates (replicas with a scraped finish counter only), and the
        replicas whose own unseen share is at the signal's threshold."""
        engine = seen = own = 0.0
        unseen: list[str] = []
        for r in self.replicas.values():
            if r.scraped is None or r.scraped.finished is None:
                continue
            finished, known = self.finishes_and_seen_per_s(r, now)
            engine += finished
            seen += known
            own += r.arrivals.per_s(now)
            if finished > 0 and finished - known >= UNSEEN_SHARE_ON * finished:
                unseen.append(r.name)
        self.blindness.update(now, Observation(engine, seen, own), unseen)

    async def _check_health(self, replica: Replica) -> None:
        health = self.health
        ok = await probe_health(self.client, replica.url, health.timeout_s)
        if ok:
            models = await fetch_models(self.client, replica.url, health.timeout_s)
            if models is not None:
                replica.served_models = models
        was_down = replica.health.up is False
        transition = replica.health.observe(ok, health)
        if self.replicas.get(replica.name) is not replica:
            return
        if transition is None:
            if ok and replica.recovery_scrapes:
                await self._recover(replica)
            return
        if transition == "down":
            replica.healthy = False
            replica.recovery_scrapes = 0
            log.warning("replica %s marked down (health checks failing)", replica.name)
            self._notify("on_reset", replica.name, "down")  # a dead engine's cache is gone: no hit, no source
        elif was_down:
            await self._recover(replica)
        else:
            replica.healthy = True

    async def _recover(self, replica: Replica) -> None:
        """Health probes pass again after an outage. A fresh process start time tells the index whether what it
        learned while the replica was down came from the engine now running, so the replica takes requests only
        once a scrape has answered (or ``RECOVERY_SCRAPES`` probes found none): a recovery decided without it would
        forget what the running engine published meanwhile. Nothing routes here or scrapes in the loop until then."""
        load = await self._scrape(replica)
        if self.replicas.get(replica.name) is not replica or replica.health.up is not True:
            return
        if load is None and replica.recovery_scrapes < RECOVERY_SCRAPES - 1:
            replica.recovery_scrapes += 1
            return
        replica.recovery_scrapes = 0
        replica.generation += 1
        replica.breaker.reset()
        replica.healthy = True
        log.warning("replica %s recovered: generation %d", replica.name, replica.generation)
        self._notify("on_recovered", replica.name, None if load is None else load.started_at)

    def _notify(self, event: str, *args: Any) -> None:
        for listener in list(self.listeners):
            try:
                getattr(listener, event)(*args)
            except Exception:  # one broken listener must not break the fleet or the others
                log.exception("fleet listener %r failed on %s", listener, event)


def _same_engine(a: ReplicaConfig, b: ReplicaConfig) -> bool:
    """Same engine and event stream behind both configs (only labels may change in place)."""
    fields = ("url", "engine", "kv_events", "kv_replay", "kv_topic")
    return all(getattr(a, f) == getattr(b, f) for f in fields)
