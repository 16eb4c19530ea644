"""The blindness signal: the engines finishing more than this gateway and its peers sent them, judged with evidence
floors and hysteresis, on the fleet's own rates with an injected clock."""

from __future__ import annotations

import logging

import aiohttp
import pytest

from kvgate.router.fleet.blindness import (
    MIN_ENGINE_PER_S, SUSTAIN_S, UNSEEN_SHARE_OFF, UNSEEN_SHARE_ON, Blindness, Observation,
)
from kvgate.router.fleet.peer_work import PeerWork
from kvgate.router.fleet.tickets import DispatchedWork
from kvgate.router.settings.schema import parse_config
from kvgate.router.upstream.scrape import ScrapedLoad
from tests.fleets import fleet_of


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
    assert len(warnings) == 1 and "configure peers" in warnings[0].getMessage() and "r0, r1" in warnings[0].getMessage()
    for _ in range(int(SUSTAIN_S) * 2):  # between the two thresholds: stays blind, and says so once only
        t += 1
        b.update(t, seen((UNSEEN_SHARE_ON + UNSEEN_SHARE_OFF) / 2))
    assert b.blind and len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    for _ in range(int(SUSTAIN_S) + 1):
        t += 1
        b.update(t, seen(0.0))
    assert not b.blind
    assert b.state(t + 5) == {"blind": False, "unseen_share": 0.0, "for_s": 5.0}


def test_no_evidence_while_blind_clears_it_in_time() -> None:
    b = Blindness()
    for t in range(int(SUSTAIN_S) + 1):
        b.update(float(t), seen(0.6))
    assert b.blind
    for t in range(int(SUSTAIN_S) + 1, int(SUSTAIN_S) * 2 + 3):
        b.update(float(t), Observation(0.0, 0.0, 0.0))
    assert not b.blind


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CONFIG = """
replicas:
  - {name: r0, url: "http://127.0.0.1:1"}
  - {name: r1, url: "http://127.0.0.1:2"}
"""


async def run_fleet(engine_multiple: float, peers_report: bool, seconds: float = 40.0) -> tuple[bool, float]:
    """This gateway sends 5 requests a second over two replicas, each over at once; the engines finish
    ``engine_multiple`` times that (other callers send the rest), which peers report when ``peers_report``. Returns
    whether the signal ever rose and the largest unseen rate on a replica at the end."""
    clock = Clock()
    async with aiohttp.ClientSession() as session:
        fleet = fleet_of(parse_config(CONFIG), session, clock)
        if peers_report:
            fleet.peer_work = PeerWork(1.0, clock)
        finished = {"r0": 0.0, "r1": 0.0}
        ever_blind = False
        step, sent = 0.1, 0
        start = clock.now
        while clock.now - start < seconds:
            clock.now += step
            if round((clock.now - start) / step) % 2 == 0:  # every 0.2 s, alternately
                name = ("r0", "r1")[sent % 2]
                sent += 1
                fleet.dispatch(name, 100).finish(True)
                finished[name] += engine_multiple
            for name, replica in fleet.replicas.items():
                replica.record_scrape(ScrapedLoad(at=clock.now, finished=int(finished[name])), replica.begin_scrape())
            if peers_report:
                assert fleet.peer_work is not None
                others = 2.5 * (engine_multiple - 1.0)
                fleet.peer_work.update("peer", clock.now, {n: DispatchedWork(0, 0, others) for n in finished})
            fleet.judge_blindness(clock.now)
            ever_blind |= fleet.blindness.blind
        return ever_blind, max(rate for _, rate in fleet.unseen_rates())


async def test_three_blind_gateways_raise_it_and_three_with_peers_never_do() -> None:
    blind, unseen = await run_fleet(3.0, peers_report=False)
    assert blind and unseen > 3.0  # two thirds of each replica's 7.5 finishes a second
    blind, unseen = await run_fleet(3.0, peers_report=True)
    assert not blind and unseen < 0.5
    blind, _ = await run_fleet(1.0, peers_report=False)  # alone in front of the fleet
    assert not blind
