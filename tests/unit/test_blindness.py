"""The blindness signal: the engines finishing more than this gateway and its peers sent them, judged with evidence
floors and hysteresis, on the fleet's own rates with an injected clock."""

from __future__ import annotations

import logging

import pytest

from kvgate.router.fleet.blindness import (
    MAX_NAMED_REPLICAS, MIN_ENGINE_PER_S, SUSTAIN_S, UNSEEN_SHARE_OFF, UNSEEN_SHARE_ON, Blindness, Observation, named,
)
from kvgate.router.fleet.peer_work import PeerWork
from kvgate.router.fleet.tickets import DispatchedWork, LoadTicket
from kvgate.router.settings.schema import parse_config
from kvgate.router.upstream.scrape import ScrapedLoad
from kvgate.router.upstream.client import EngineClient
from tests.fleets import fleet_of
from tests.support import ManualClock


def seen(share: float, engine: float = 10.0) -> Observation:
    """An observation whose unseen share is ``share``."""
    return Observation(engine, engine * (1.0 - share), engine * (1.0 - share))


def test_no_evidence_is_no_judgement() -> None:
    assert Observation(MIN_ENGINE_PER_S / 2, 0.0, 5.0).unseen_share is None  # the engines are nearly idle
    assert Observation(20.0, 0.0, 0.1).unseen_share is None  # this gateway is idle: every finish looks unseen
    assert Observation(20.0, 25.0, 25.0).unseen_share == 0.0  # more seen than finished (queues building)
    assert Observation(30.0, 10.0, 10.0).unseen_share == pytest.approx(2 / 3)


def test_the_signal_needs_a_sustained_share_to_rise_and_to_clear(caplog: pytest.LogCaptureFixture) -> None:
    b = Blindness()
    caplog.set_level(logging.INFO, logger="kvgate.router.fleet.blindness")
    t = 0.0
    while t < SUSTAIN_S - 1:
        b.update(t, seen(0.6))
        t += 1
    assert not b.blind
    b.update(t, seen(UNSEEN_SHARE_ON / 2))  # a dip below the threshold restarts the count
    for _ in range(int(SUSTAIN_S)):
        t += 1
        b.update(t, seen(0.6), ["r0", "r1"])
    assert not b.blind
    t += 1
    b.update(t, seen(0.6), ["r0", "r1"])
    assert b.blind and b.since == t
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warnings[0].getMessage()
    assert len(warnings) == 1 and "configure peers" in message and "r0, r1" in message and "60%" in message
    assert "other gateways" in message and "clients calling the engines directly" in message
    for _ in range(int(SUSTAIN_S) * 2):  # between the two thresholds: stays blind, and says so once only
        t += 1
        b.update(t, seen((UNSEEN_SHARE_ON + UNSEEN_SHARE_OFF) / 2))
    assert b.blind and len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    for _ in range(int(SUSTAIN_S) + 1):
        t += 1
        b.update(t, seen(0.0))
    assert not b.blind
    assert [r.levelno for r in caplog.records].count(logging.INFO) == 1
    assert b.state(t + 5) == {"blind": False, "unseen_share": 0.0, "for_s": 5.0, "replicas": [], "replicas_total": 0}


def test_the_replicas_named_are_capped() -> None:
    b = Blindness()
    names = [f"r{i:03d}" for i in range(MAX_NAMED_REPLICAS * 3)]
    b.update(0.0, seen(0.6), names)
    state = b.state(0.0)
    assert state["replicas"] == names[:MAX_NAMED_REPLICAS] and state["replicas_total"] == len(names)
    assert named(names).endswith(f"and {len(names) - MAX_NAMED_REPLICAS} more")


def test_no_evidence_while_blind_clears_it_in_time() -> None:
    b = Blindness()
    for t in range(int(SUSTAIN_S) + 1):
        b.update(float(t), seen(0.6))
    assert b.blind
    for t in range(int(SUSTAIN_S) + 1, int(SUSTAIN_S) * 2 + 3):
        b.update(float(t), Observation(0.0, 0.0, 0.0))
    assert not b.blind


CONFIG = """
replicas:
  - {name: r0, url: "http://127.0.0.1:1"}
  - {name: r1, url: "http://127.0.0.1:2"}
"""


async def run_fleet(
    engine_multiple: float, peers_report: bool, seconds: float = 40.0, latency_s: float = 0.0,
    send_for_s: float | None = None,
) -> tuple[float | None, float]:
    """This gateway sends 5 requests a second over two replicas (for ``send_for_s``, else throughout), each finished
    by its engine ``latency_s`` after it was sent; the engines finish ``engine_multiple`` times that (other callers
    send the rest), which peers report when ``peers_report``. The engine's counter counts a request before the
    gateway reads its end (a scrape later). Returns when the signal rose (seconds after the first request, None if
    never) and the largest unseen rate on a replica at the end."""
    clock = ManualClock(1000.0)
    async with EngineClient(8) as session:
        fleet = fleet_of(parse_config(CONFIG), session, clock)
        if peers_report:
            fleet.peer_work = PeerWork(1.0, clock)
        finished = {"r0": 0.0, "r1": 0.0}
        in_flight: list[tuple[float, str, LoadTicket]] = []
        engine_done: list[LoadTicket] = []
        rose_at: float | None = None
        step, sent = 0.1, 0
        start = clock.now
        while clock.now - start < seconds:
            clock.now += step
            elapsed = clock.now - start
            for ticket in engine_done:  # the end the engine counted at the last scrape reaches the gateway
                ticket.finish(True)
            engine_done = []
            if (send_for_s is None or elapsed < send_for_s) and round(elapsed / step) % 2 == 0:  # every 0.2 s
                name = ("r0", "r1")[sent % 2]
                sent += 1
                in_flight.append((clock.now + latency_s, name, fleet.dispatch(name, 100)))
            for due, name, ticket in [f for f in in_flight if f[0] <= clock.now + 1e-9]:
                in_flight.remove((due, name, ticket))
                finished[name] += engine_multiple
                engine_done.append(ticket)
            for name, replica in fleet.replicas.items():
                replica.record_scrape(ScrapedLoad(at=clock.now, finished=int(finished[name])), replica.begin_scrape())
            if peers_report:
                assert fleet.peer_work is not None
                others = 2.5 * (engine_multiple - 1.0)
                fleet.peer_work.update("peer", clock.now, {n: DispatchedWork(0, 0, others) for n in finished})
            fleet.judge_blindness(clock.now)
            if fleet.blindness.blind and rose_at is None:
                rose_at = elapsed
        return rose_at, max(rate for _, rate in fleet.unseen_rates())


async def test_three_blind_gateways_raise_it_and_three_with_peers_never_do() -> None:
    rose_at, unseen = await run_fleet(3.0, peers_report=False)
    assert rose_at is not None and rose_at <= SUSTAIN_S + 2.0  # the rates read right from the start
    assert unseen > 3.0  # two thirds of each replica's 7.5 finishes a second
    rose_at, unseen = await run_fleet(3.0, peers_report=True)
    assert rose_at is None and unseen < 0.5
    rose_at, _ = await run_fleet(1.0, peers_report=False)  # alone in front of the fleet
    assert rose_at is None


async def test_requests_in_flight_are_not_unseen() -> None:
    """Requests that take 6 s: for the first 6 s the gateway has dispatched 30 the engines have not finished, and
    once it stops they finish 30 it no longer sends. Neither is load it cannot see (compared with its dispatches,
    the engines' finishes would read 34% unseen for the 20 s after it stops)."""
    rose_at, unseen = await run_fleet(1.0, peers_report=False, seconds=60.0, latency_s=6.0, send_for_s=30.0)
    assert rose_at is None and unseen < 0.5
    # and with peers, whose reports are dispatches: their in-flight requests make them look ahead, never behind
    rose_at, unseen = await run_fleet(3.0, peers_report=True, seconds=60.0, latency_s=6.0, send_for_s=30.0)
    assert rose_at is None
    # while requests in flight do not hide other callers' load
    rose_at, _ = await run_fleet(3.0, peers_report=False, seconds=40.0, latency_s=6.0)
    assert rose_at is not None and rose_at <= 6.0 + SUSTAIN_S + 2.0


async def test_a_quiet_fleet_decides_nothing() -> None:
    """Below the evidence floors the share is not judged: one request every 2 s here and two gateways' worth of
    unseen finishes elsewhere stay unjudged."""
    clock = ManualClock(1000.0)
    async with EngineClient(8) as session:
        fleet = fleet_of(parse_config(CONFIG), session, clock)
        finished = 0
        for i in range(600):
            clock.now += 0.1
            if i % 20 == 0:
                fleet.dispatch("r0", 100).finish(True)
                finished += 3
            replica = fleet.replicas["r0"]
            replica.record_scrape(ScrapedLoad(at=clock.now, finished=finished), replica.begin_scrape())
            fleet.judge_blindness(clock.now)
            assert not fleet.blindness.blind and fleet.blindness.share is None
