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
from tests.integration.test_gateway import MODEL, gateway_config
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until_async

pytestmark = pytest.mark.integration

ADMIN = "admin-s3cret-blind"
PEER_TOKEN = "peer-s3cret-blind"
RATE_PER_GATEWAY = 4.0
"""Requests a second each gateway sends: above the signal's evidence floors (1/s own, 2/s at the engines)."""
RAISED_WITHIN_S = 45.0
"""The decayed rates' warm-up, the 10 s the share must hold, a scrape interval and a loaded machine's slack."""
PEERS_WATCHED_S = 30.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("blindness")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0")
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
    """Each gateway gets ``RATE_PER_GATEWAY`` short completions a second until ``stop``; returns how many were ok."""
    ok = 0
    body = {"model": MODEL, "prompt": "how many gateways are there? " * 4, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10) as client:
        for n in itertools.count():
            if stop.is_set():
                return ok
            gw = gateways[n % len(gateways)]
            resp = await client.post(gw.url + "/v1/completions", json=body)
            ok += resp.status_code == 200
            await asyncio.sleep(1.0 / (RATE_PER_GATEWAY * len(gateways)))
    return ok


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
                await wait_until_async(lambda: _all_blind(client, gateways), "every gateway to say it is blind",
                                       timeout=RAISED_WITHIN_S)
                assert time.monotonic() - started < RAISED_WITHIN_S
                listing = (await client.get(gateways[0].url + "/admin/replicas",
                                            headers={"Authorization": f"Bearer {ADMIN}"})).json()
        finally:
            stop.set()
            assert await traffic > 0
    assert listing["blind"]["blind"] is True and listing["blind"]["unseen_share"] > 0.25
    assert any(r["unseen_request_rate_per_s"] > 0 for r in listing["data"])


async def _all_blind(client: httpx.AsyncClient, gateways: list[Gateway]) -> bool:
    return all(flag == 1.0 for flag in await blind_flags(client, gateways))


async def test_three_gateways_with_peers_never_do(sim: Sim, workdir: Path) -> None:
    with three_gateways(sim, workdir, "peers", peers=True) as gateways:
        stop = asyncio.Event()
        traffic = asyncio.create_task(send_traffic(gateways, stop))
        seen: list[float] = []
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                deadline = time.monotonic() + PEERS_WATCHED_S
                while time.monotonic() < deadline:
                    seen += await blind_flags(client, gateways)
                    await asyncio.sleep(0.5)
        finally:
            stop.set()
            assert await traffic > 0
    assert seen and not any(seen)
