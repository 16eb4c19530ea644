"""Three gateways in front of one fleet: without peers each sees the engines finish about three times what it sent
and raises the blindness signal within a bounded time; with peer hints configured, none ever does."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvgate.loadgen.bench import free_port_block
from kvgate.router.fleet.blindness import SUSTAIN_S
from tests.integration.test_gateway import MODEL, gateway_config
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until_async

pytestmark = pytest.mark.integration

ADMIN = "admin-s3cret-blind"
PEER_TOKEN = "peer-s3cret-blind"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
REPLICAS = 3
RATE_PER_GATEWAY = 4.0
"""Requests a second each gateway is sent, whatever the answers take: above the signal's evidence floors (1/s of its
own, 2/s at the engines)."""
BODY = {"model": MODEL, "prompt": "how many gateways are there? " * 4, "max_tokens": 32, "ignore_eos": True}
"""About 0.3 s on the sim at time scale 1: a few requests are always in flight, which is not unseen load."""
RAISED_WITHIN_S = SUSTAIN_S + 35.0
"""The share must hold for ``SUSTAIN_S``; the rest is the gateways' start, a scrape interval and a loaded machine's
slack (it takes about ``SUSTAIN_S`` + 2 s on an idle one)."""
PEERS_WATCHED_S = SUSTAIN_S * 3
"""Three times what the share must hold for the signal to rise: long enough that it would have risen."""
PEERS_HEARD_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("blindness")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, REPLICAS, "--time-scale", "1")
    try:
        yield s
    finally:
        s.stop()


@contextmanager
def three_gateways(sim: Sim, workdir: Path, tag: str, peers: bool) -> Iterator[list[Gateway]]:
    endpoints = [f"tcp://127.0.0.1:{free_port_block(1)}" for _ in range(3)]
    started: list[Gateway] = []
    try:
        for i in range(3):
            sections: dict = {"server": {"admin_token": ADMIN, "peer_token": PEER_TOKEN}}
            if peers:
                sections["peers"] = {"hints": {"bind": endpoints[i],
                                               "connect": [e for j, e in enumerate(endpoints) if j != i]}}
            started.append(start_kvgate(workdir, gateway_config(sim, workdir, f"{tag}-{i}.yaml", **sections)))
        yield started
    finally:
        for gw in started:
            gw.stop()


async def send_traffic(gateways: list[Gateway], stop: asyncio.Event) -> int:
    """``RATE_PER_GATEWAY`` requests a second to each gateway, in turn, each sent on time whether or not the earlier
    ones are answered, until ``stop``; returns how many were answered 200."""
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(gw: Gateway) -> bool:
            return (await client.post(gw.url + "/v1/completions", json=BODY)).status_code == 200

        sent: list[asyncio.Task[bool]] = []
        for n in itertools.count():
            if stop.is_set():
                break
            sent.append(asyncio.create_task(one(gateways[n % len(gateways)])))
            try:
                await asyncio.wait_for(stop.wait(), 1.0 / (RATE_PER_GATEWAY * len(gateways)))
            except TimeoutError:
                pass
        return sum(await asyncio.gather(*sent))


async def blind_flags(client: httpx.AsyncClient, gateways: list[Gateway]) -> list[float]:
    flags = []
    for gw in gateways:
        text = (await client.get(gw.url + "/metrics")).text
        line = next(line for line in text.splitlines() if line.startswith("kvgate_blind "))
        flags.append(float(line.rsplit(" ", 1)[1]))
    return flags


async def test_three_gateways_without_peers_raise_the_signal(sim: Sim, workdir: Path) -> None:
    with three_gateways(sim, workdir, "blind", peers=False) as gateways:
        stop = asyncio.Event()
        traffic = asyncio.create_task(send_traffic(gateways, stop))
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                started = time.monotonic()

                async def all_blind() -> bool:
                    return all(flag == 1.0 for flag in await blind_flags(client, gateways))

                await wait_until_async(all_blind, "every gateway to say it is blind", timeout=RAISED_WITHIN_S)
                print(f"\nevery gateway blind {time.monotonic() - started:.1f} s after the traffic began")
                listing = (await client.get(gateways[0].url + "/admin/replicas", headers=ADMIN_HEADERS)).json()
                state = (await client.get(gateways[1].url + "/admin/state", headers=ADMIN_HEADERS)).json()
        finally:
            stop.set()
            assert await traffic > 0
    for blind in (listing["blind"], state["blind"]):
        assert blind["blind"] is True and blind["unseen_share"] > 0.25 and blind["for_s"] >= 0
        assert blind["replicas_total"] >= 1
    for rows in (listing["data"], state["replicas"]):
        assert sum(r["unseen_request_rate_per_s"] for r in rows) > 0
    for gw in gateways:
        log = gw.process.output()
        warnings = [line for line in log.splitlines() if "sent by nobody this gateway knows" in line]
        assert len(warnings) == 1 and "configure peers" in warnings[0] and "clients calling the engines" in warnings[0]


async def test_three_gateways_with_peers_never_do(sim: Sim, workdir: Path) -> None:
    with three_gateways(sim, workdir, "peers", peers=True) as gateways:
        stop = asyncio.Event()
        traffic = asyncio.create_task(send_traffic(gateways, stop))
        seen: list[float] = []
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                async def every_peer_reports() -> bool:
                    seen.extend(await blind_flags(client, gateways))
                    states = [(await client.get(gw.url + "/admin/state", headers=ADMIN_HEADERS)).json()
                              for gw in gateways]
                    return all(s["peers"]["reporting_total"] == 2 for s in states)

                await wait_until_async(every_peer_reports, "each gateway to hear its two peers' work reports",
                                       timeout=PEERS_HEARD_WITHIN_S)
                deadline = time.monotonic() + PEERS_WATCHED_S
                while time.monotonic() < deadline:  # sampled through the whole run
                    seen += await blind_flags(client, gateways)
                    await asyncio.sleep(0.25)
                listings = [(await client.get(gw.url + "/admin/replicas", headers=ADMIN_HEADERS)).json()
                            for gw in gateways]
        finally:
            stop.set()
            assert await traffic > 0
    assert len(seen) >= 3 * PEERS_WATCHED_S and not any(seen)
    for listing in listings:  # judged, on evidence, and found accounted for
        share = listing["blind"]["unseen_share"]
        assert share is not None and share < 0.25, listing["blind"]
