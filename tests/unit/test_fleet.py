"""Fleet: load accounting, views and staleness, membership and reload diffing, and the health/scrape loops against a
real aiohttp engine stand-in on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvgate.cache_index.match import PrefixMatch
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.peer_work import PeerWork
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import FleetListener
from kvgate.router.fleet.tickets import DispatchedWork
from kvgate.router.settings.schema import KvgateConfig, parse_config
from kvgate.router.upstream.health import HealthState
from kvgate.router.upstream.scrape import ScrapedLoad
from kvgate.router.upstream.client import EngineClient
from tests.fleets import fleet_of, reconfigure
from tests.support import ManualClock, wait_until_async

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


@dataclass
class Recorder(FleetListener):
    events: list[tuple[str, ...]] = field(default_factory=list)

    def on_added(self, replica: Replica) -> None:
        self.events.append(("added", replica.name))

    def on_removed(self, name: str) -> None:
        self.events.append(("removed", name))

    def on_reset(self, name: str, reason: str) -> None:
        self.events.append(("reset", name, reason))

    def on_recovered(self, name: str, started_at: float | None) -> None:
        self.events.append(("recovered", name, str(started_at)))


def config(*names: str, extra: str = "") -> KvgateConfig:
    replicas = "".join(f"  - {{name: {n}, url: 'http://127.0.0.1:9/{n}'}}\n" for n in names)
    return parse_config(f"replicas:\n{replicas}{extra}" if names else extra)


@pytest.fixture
async def session() -> AsyncIterator[EngineClient]:
    async with EngineClient(8) as s:
        yield s


async def test_ticket_accounting_is_exact_and_idempotent(session: EngineClient) -> None:
    fleet = fleet_of(config("a"), session)
    r = fleet.replicas["a"]
    t1 = fleet.dispatch("a", 100)
    t2 = fleet.dispatch("a", 50)
    t3 = fleet.dispatch("a", 0)  # a full cache hit still waits for its first engine step
    assert (r.in_flight, r.in_flight_prefilling, r.in_flight_prefill_tokens) == (3, 3, 150)
    t1.first_token()
    t1.first_token()
    t3.first_token()
    assert (r.in_flight, r.in_flight_prefilling, r.in_flight_prefill_tokens) == (3, 1, 50)
    t1.finish(ok=True)
    t1.finish(ok=False)
    t3.finish(ok=True)
    assert (r.in_flight, r.in_flight_prefilling, r.in_flight_prefill_tokens) == (1, 1, 50)
    assert r.breaker.consecutive_failures == 0
    t2.finish(ok=False)  # finish without first token releases the prefill tokens too
    assert (r.in_flight, r.in_flight_prefilling, r.in_flight_prefill_tokens) == (0, 0, 0)
    assert r.breaker.consecutive_failures == 1


async def test_failed_tickets_open_the_breaker(session: EngineClient) -> None:
    fleet = fleet_of(config("a", extra="breaker: {failures_to_open: 2, open_s: 5}\n"), session)
    r = fleet.replicas["a"]
    r.healthy = True
    for _ in range(2):
        fleet.dispatch("a", 10).finish(ok=False)
    assert r.breaker.state == "open"
    assert not r.routable()
    assert fleet.routable() == []


async def test_at_most_the_ejectable_fraction_of_the_fleet_is_ejected(session: EngineClient) -> None:
    fleet = fleet_of(config("a", "b", "c", "d", extra="breaker: {failures_to_open: 1, max_ejected_fraction: 0.5}\n"),
                     session)
    for name in fleet.replicas:
        fleet.replicas[name].healthy = True
        fleet.dispatch(name, 10).finish(ok=False)
    assert sorted(r.breaker.state for r in fleet.replicas.values()) == ["closed", "closed", "open", "open"]
    assert len(fleet.routable()) == 2 and len(fleet.serving()) == 4  # readiness does not follow the circuits


async def test_an_unblamed_failure_counts_once_blamed(session: EngineClient) -> None:
    fleet = fleet_of(config("a", extra="breaker: {failures_to_open: 2}\n"), session)
    r = fleet.replicas["a"]
    tickets = [fleet.dispatch("a", 10) for _ in range(3)]
    for ticket in tickets:
        ticket.finish(ok=None)
    assert r.in_flight == 0 and r.breaker.consecutive_failures == 0
    tickets[0].blame()
    tickets[1].blame()
    assert r.breaker.state == "open"


async def test_arrival_rate_counts_other_callers_from_the_engines_finish_counter(session: EngineClient) -> None:
    clock = ManualClock(1000.0)
    fleet = fleet_of(config("a"), session, clock=clock)
    r = fleet.replicas["a"]
    r.healthy = True
    for _ in range(100):  # this gateway sends 1 request/s; the engine finishes 4/s (three other callers)
        fleet.dispatch("a", 10).finish(ok=True)
        r.record_scrape(ScrapedLoad(at=clock.now, finished=4.0 * clock.now), 0)
        clock.now += 1.0
    assert fleet.view("a", PrefixMatch()).arrival_rate_per_s == pytest.approx(4.0, rel=0.1)
    r.record_scrape(ScrapedLoad(at=clock.now, finished=2.0), 0)  # counter went down: the engine restarted
    assert r.arrival_rate_per_s(clock.now) == pytest.approx(4.0 * 0.5 ** (1 / 10), rel=0.1)  # nothing added
    quiet = fleet_of(config("b"), session, clock=clock)
    for _ in range(120):  # no scrape counter (an engine without it): the gateway's own rate
        quiet.dispatch("b", 10).finish(ok=True)
        clock.now += 0.5
    assert quiet.view("b", PrefixMatch()).arrival_rate_per_s == pytest.approx(2.0, rel=0.15)


async def test_peers_work_adds_to_the_queue_and_the_arrival_rate(session: EngineClient) -> None:
    """Peer gateways' reports add to this gateway's own load: the engine's finish rate trails the arrivals while a
    queue builds, and an arrival rate too low prices a long prefill on a busy replica as cheap for its neighbours."""
    clock = ManualClock(1000.0)
    fleet = fleet_of(config("a", "b"), session, clock=clock)
    for _ in range(100):  # this gateway sends 1 request/s
        fleet.dispatch("a", 10).finish(ok=True)
        clock.now += 1.0
    ticket = fleet.dispatch("a", 500)
    own = fleet.dispatched_work()
    assert list(own) == ["a"] and own["a"][:2] == (500, 1)
    assert own["a"].arrival_rate_per_s == pytest.approx(1.0, rel=0.1)
    fleet.peer_work = PeerWork(1.0, clock=lambda: 0.0)
    assert fleet.peer_work.update("peer", 0.0, {"a": DispatchedWork(3000, 2, 2.0)})
    view = fleet.view("a", PrefixMatch())
    assert (view.in_flight_prefill_tokens, view.in_flight_prefilling) == (3500, 3)
    assert view.arrival_rate_per_s == pytest.approx(3.0, rel=0.05)
    assert fleet.arrival_rate_per_s(fleet.replicas["a"]) == view.arrival_rate_per_s  # what /admin/replicas shows
    ticket.first_token()
    assert fleet.dispatched_work()["a"][:2] == (0, 0)
    assert fleet.view("b", PrefixMatch()).arrival_rate_per_s == 0.0


async def test_view_ignores_stale_scrapes(session: EngineClient) -> None:
    clock = ManualClock(1000.0)
    fleet = fleet_of(config("a", extra="scrape: {stale_after_ms: 500}\n"), session, clock=clock)
    r = fleet.replicas["a"]
    r.healthy = True
    r.scraped = ScrapedLoad(at=clock.now, waiting=4, running=2, kv_usage=0.5)
    fleet.dispatch("a", 30)
    v = fleet.view("a", PrefixMatch(gpu=16), session_match=True)
    assert v.healthy and v.match.gpu == 16 and v.last_session_match
    assert (v.in_flight, v.in_flight_prefilling, v.in_flight_prefill_tokens) == (1, 1, 30)
    assert (v.scraped_waiting, v.scraped_running, v.kv_usage) == (4, 2, 0.5)
    clock.now += 0.6
    v = fleet.view("a", PrefixMatch())
    assert (v.scraped_waiting, v.scraped_running, v.kv_usage) == (None, None, None)
    assert v.in_flight == 1


async def test_own_prefilling_is_bounded_by_what_the_engine_holds_and_what_was_sent_since(
    session: EngineClient,
) -> None:
    """Answers read whole count as prefilling until they are read (after their decode, and on a busy loop after the
    engine is done): the engine's own count at the last scrape, plus what was sent since, bounds them."""
    clock = ManualClock(1000.0)
    fleet = fleet_of(config("a"), session, clock=clock)
    r = fleet.replicas["a"]
    r.healthy = True
    tickets = [fleet.dispatch("a", 100) for _ in range(10)]
    epoch = r.begin_scrape()
    r.record_scrape(ScrapedLoad(at=clock.now, waiting=0, running=3), epoch)  # the engine holds 3 of them
    v = fleet.view("a", PrefixMatch())
    assert (v.in_flight_prefilling, v.in_flight_prefill_tokens, v.in_flight) == (3, 300, 10)
    tickets += [fleet.dispatch("a", 100) for _ in range(2)]  # sent after the scrape was asked for: they count
    assert fleet.view("a", PrefixMatch()).in_flight_prefilling == 5
    tickets[-1].first_token()  # ... until their first token
    assert fleet.view("a", PrefixMatch()).in_flight_prefilling == 4
    epoch = r.begin_scrape()
    tickets.append(fleet.dispatch("a", 100))  # in flight while the scrape is asked for: not in its counts
    r.record_scrape(ScrapedLoad(at=clock.now, waiting=8, running=2), epoch)
    assert fleet.view("a", PrefixMatch()).in_flight_prefilling == 11
    for ticket in tickets:
        ticket.finish(ok=True)
    assert r.prefilling_by_epoch == {} and fleet.view("a", PrefixMatch()).in_flight_prefilling == 0
    tickets = [fleet.dispatch("a", 100) for _ in range(4)]
    r.record_scrape(ScrapedLoad(at=clock.now, kv_usage=0.1), r.begin_scrape())  # no counts: the router's own
    assert fleet.view("a", PrefixMatch()).in_flight_prefilling == 4
    clock.now += 10.0  # a stale scrape bounds nothing either
    r.record_scrape(ScrapedLoad(at=0.0, waiting=0, running=0), r.begin_scrape())
    assert fleet.view("a", PrefixMatch()).in_flight_prefilling == 4


async def test_drain_stops_routing_but_keeps_the_cache_as_a_transfer_source(session: EngineClient) -> None:
    fleet = fleet_of(config("a", "b"), session)
    rec = Recorder()
    fleet.listeners.append(rec)
    for r in fleet.replicas.values():
        r.healthy = True
    fleet.drain("a")
    fleet.drain("a")
    assert [r.name for r in fleet.routable()] == ["b"]
    v = fleet.view("a", PrefixMatch(gpu=32))
    assert (v.healthy, v.draining, v.can_source, v.match.gpu) == (False, True, True, 32)
    assert rec.events == []  # the engine still holds its cache: the index keeps it
    with pytest.raises(KeyError):
        fleet.drain("nope")


async def test_only_a_healthy_engine_with_a_closed_breaker_can_source(session: EngineClient) -> None:
    fleet = fleet_of(config("a", "b"), session)
    a, b = fleet.replicas.values()
    a.healthy, b.healthy = False, True
    assert not fleet.view("a", PrefixMatch()).can_source
    for _ in range(fleet.breaker.failures_to_open):
        b.breaker.record_failure()
    v = fleet.view("b", PrefixMatch())
    assert b.breaker.state == "open" and not v.can_source and not v.healthy


async def test_models_union_and_lora_base(session: EngineClient) -> None:
    fleet = fleet_of(config("a", "b", "c"), session)
    a, b, c = fleet.replicas.values()
    a.healthy = b.healthy = True
    a.served_models = [{"id": "base", "root": "base", "parent": None}]
    b.served_models = [
        {"id": "base", "root": "base", "parent": None},
        {"id": "sql-lora", "root": "/loras/sql", "parent": "base"},
    ]
    c.served_models = [{"id": "only-on-down-replica"}]
    assert [m["id"] for m in fleet.models()] == ["base", "sql-lora"]
    assert fleet.base_model_of("sql-lora") == ("base", "sql-lora")
    assert fleet.base_model_of("base") == ("base", None)
    assert fleet.base_model_of("unknown") == ("unknown", None)


async def test_apply_config_diffs_file_replicas_and_keeps_admin_ones(session: EngineClient) -> None:
    fleet = fleet_of(config("a", "b", "c"), session)
    rec = Recorder()
    fleet.listeners.append(rec)
    await fleet.start()
    try:
        rec.events.clear()
        b_before = fleet.replicas["b"]
        c_before = fleet.replicas["c"]
        fleet.add(ReplicaConfig(name="admin1", url="http://127.0.0.1:9/x"))
        new = parse_config(
            "breaker: {failures_to_open: 9}\n"
            "replicas:\n"
            "  - {name: b, url: 'http://127.0.0.1:9/b', labels: {zone: z1}}\n"
            "  - {name: c, url: 'http://127.0.0.1:9/c-moved'}\n"
            "  - {name: d, url: 'http://127.0.0.1:9/d'}\n"
        )
        reconfigure(fleet, new)
        assert list(fleet.replicas) == ["b", "admin1", "c", "d"]
        assert fleet.replicas["b"] is b_before and b_before.config.labels == {"zone": "z1"}
        assert fleet.replicas["c"] is not c_before and fleet.replicas["c"].url.endswith("/c-moved")
        assert b_before.breaker.config.failures_to_open == 9
        assert rec.events == [
            ("added", "admin1"),
            ("removed", "a"),
            ("removed", "c"),
            ("added", "c"),
            ("added", "d"),
        ]
        with pytest.raises(ValueError):
            fleet.add(ReplicaConfig(name="d", url="http://127.0.0.1:9/d"))
        await fleet.remove("admin1")
        assert "admin1" not in fleet.replicas
    finally:
        await fleet.stop()


class FakeEngine:
    """A vLLM-shaped engine stand-in whose /health can be switched off."""

    def __init__(self) -> None:
        self.healthy = True
        self.metrics = VLLM_METRICS
        self.metrics_status = 200
        self.scrapes = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/metrics", self._metrics)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "parent": None}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=self.metrics, status=self.metrics_status)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    eng = FakeEngine()
    runner = web.AppRunner(eng.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield eng, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_health_loop_marks_down_and_recovery_bumps_generation(
    session: EngineClient, engine: tuple[FakeEngine, str]
) -> None:
    eng, url = engine
    cfg = parse_config(
        f"replicas: [{{name: e, url: '{url}'}}]\n"
        "health: {interval_s: 0.02, timeout_s: 0.5, failures_to_down: 2, successes_to_up: 2}\n"
        "scrape: {interval_ms: 20}\n"
    )
    fleet = fleet_of(cfg, session)
    rec = Recorder()
    fleet.listeners.append(rec)
    await fleet.start()
    try:
        r = fleet.replicas["e"]
        assert r.healthy and r.generation == 0
        assert [m["id"] for m in fleet.models()] == ["m"]
        assert r.scraped is not None and (r.scraped.waiting, r.scraped.running) == (7, 3)
        eng.healthy = False
        await wait_until_async(lambda: not r.healthy)
        assert fleet.routable() == [] and fleet.models() == []
        eng.healthy = True
        await wait_until_async(lambda: r.healthy)
        assert r.generation == 1
        # The recovery carries the process start time scraped at that moment (this engine exports none).
        assert rec.events == [("added", "e"), ("reset", "e", "down"), ("recovered", "e", "None")]
    finally:
        await fleet.stop()


async def test_added_replica_gets_probed(session: EngineClient, engine: tuple[FakeEngine, str]) -> None:
    _, url = engine
    fleet = fleet_of(parse_config("health: {interval_s: 10}\nscrape: {interval_ms: 20}\n"), session)
    await fleet.start()
    try:
        r = fleet.add(ReplicaConfig(name="late", url=url))
        assert not r.routable()
        await wait_until_async(lambda: r.routable() and r.scraped is not None)
        assert r.scraped is not None and r.scraped.kv_usage == 0.25
    finally:
        await fleet.stop()


def test_health_state_flips_only_after_streaks() -> None:
    cfg = parse_config("health: {failures_to_down: 3, successes_to_up: 2}\n").health
    state = HealthState()
    assert state.observe(True, cfg) == "up"  # the first probe decides at once
    assert [state.observe(ok, cfg) for ok in (False, False, True, False, False)] == [None, None, None, None, None]
    assert state.observe(False, cfg) == "down"
    assert [state.observe(ok, cfg) for ok in (True, False, True)] == [None, None, None]
    assert state.observe(True, cfg) == "up"


async def test_a_moved_process_start_time_reports_a_restart_within_a_scrape(
    session: EngineClient, engine: tuple[FakeEngine, str]
) -> None:
    eng, url = engine
    eng.metrics = VLLM_METRICS + "process_start_time_seconds 1700000000.25\n"
    cfg = parse_config(f"replicas: [{{name: e, url: '{url}'}}]\nhealth: {{interval_s: 10}}\nscrape: {{interval_ms: 20}}\n")
    fleet = fleet_of(cfg, session)
    restarts: list[tuple[str, float]] = []

    class Restarts(FleetListener):
        def on_restarted(self, name: str, started_at: float) -> None:
            restarts.append((name, started_at))

    fleet.listeners.append(Restarts())
    await fleet.start()
    try:
        r = fleet.replicas["e"]
        assert r.engine_started_at == 1700000000.25 and restarts == []  # the first start seen is no restart
        eng.metrics = VLLM_METRICS + "process_start_time_seconds 1700000100.5\n"
        await wait_until_async(lambda: restarts == [("e", 1700000100.5)])
        assert r.healthy  # health never failed
        eng.metrics = VLLM_METRICS  # stops exporting it: nothing is inferred
        served = eng.scrapes
        await wait_until_async(lambda: eng.scrapes >= served + 3)  # the fleet has read two of them (it scrapes in turn)
        assert restarts == [("e", 1700000100.5)]
    finally:
        await fleet.stop()


async def test_a_recovery_whose_scrape_fails_waits_for_the_engines_start_time(
    session: EngineClient, engine: tuple[FakeEngine, str]
) -> None:
    """The recovery tells the index the engine's process start time, which decides whether what the index learned
    while the replica was down is kept. A /metrics that does not answer at that moment (an engine busy on a small
    machine) must not turn the recovery into a blind reset: the replica waits for the next health probe's scrape
    before it takes requests, and recovers with the start time."""
    eng, url = engine
    eng.metrics = VLLM_METRICS + "process_start_time_seconds 1700000000.25\n"
    cfg = parse_config(
        f"replicas: [{{name: e, url: '{url}'}}]\n"
        "health: {interval_s: 0.1, timeout_s: 0.5, failures_to_down: 1, successes_to_up: 1}\n"
        "scrape: {interval_ms: 20}\n"
    )
    fleet = fleet_of(cfg, session)
    rec = Recorder()
    fleet.listeners.append(rec)
    await fleet.start()
    try:
        r = fleet.replicas["e"]
        eng.healthy = False
        await wait_until_async(lambda: not r.healthy and ("reset", "e", "down") in rec.events)
        eng.metrics = VLLM_METRICS + "process_start_time_seconds 1700000100.5\n"  # restarted while down
        eng.metrics_status = 503
        scrapes = eng.scrapes
        eng.healthy = True
        await wait_until_async(lambda: eng.scrapes > scrapes)  # the recovery's scrape failed
        assert not r.routable()
        eng.metrics_status = 200
        await wait_until_async(lambda: r.healthy)
        assert rec.events[-1] == ("recovered", "e", "1700000100.5")
        assert r.generation == 1
    finally:
        await fleet.stop()
