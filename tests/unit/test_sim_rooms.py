"""The sim's bookkeeping of SGLang's P/D rooms: the fields a request carries, and a prefill replica's room table
(offered KV meeting its decode in either order, bounded waits, one handoff per room, expiry, restarts)."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.loadgen.sim.bootstrap import ROOM_MAX, BootstrapFields, RoomTable, parse_fields
from kvgate.loadgen.sim.engine import RemoteSource
from kvgate.loadgen.sim.errors import EngineError

SOURCE = RemoteSource("engine-a", "req-1")


def test_fields_absent_are_none() -> None:
    assert parse_fields({"prompt": "hi"}) is None


def test_fields_parse() -> None:
    body = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": ROOM_MAX}
    assert parse_fields(body) == BootstrapFields("10.0.0.5", 8998, ROOM_MAX)


@pytest.mark.parametrize("body, param", [
    ({"bootstrap_room": 7}, "bootstrap_host"),
    ({"bootstrap_host": "h", "bootstrap_port": 8998}, "bootstrap_room"),
    ({"bootstrap_host": "h", "bootstrap_port": 0, "bootstrap_room": 1}, "bootstrap_port"),
    ({"bootstrap_host": "h", "bootstrap_port": True, "bootstrap_room": 1}, "bootstrap_port"),
    ({"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": ROOM_MAX + 1}, "bootstrap_room"),
    ({"bootstrap_host": ["h"], "bootstrap_port": [8998], "bootstrap_room": [1]}, "bootstrap_host"),
])
def test_bad_fields_are_400(body: dict, param: str) -> None:
    with pytest.raises(EngineError) as err:
        parse_fields(body)
    assert err.value.status == 400 and err.value.param == param


async def test_offer_before_take() -> None:
    table = RoomTable(hold_s=5.0)
    table.offer(1, SOURCE)
    assert await table.take(1, timeout_s=0.1) == SOURCE
    assert not table.offers


async def test_take_before_offer() -> None:
    table = RoomTable(hold_s=5.0)
    waiting = asyncio.create_task(table.take(2, timeout_s=5.0))
    await asyncio.sleep(0)
    assert 2 in table.waiters
    table.offer(2, SOURCE)
    assert await waiting == SOURCE
    assert not table.waiters and not table.offers


async def test_take_times_out_and_forgets_the_waiter() -> None:
    table = RoomTable(hold_s=5.0)
    assert await table.take(3, timeout_s=0.01) is None
    assert not table.waiters


async def test_a_failed_prefill_fails_its_decode() -> None:
    table = RoomTable(hold_s=5.0)
    waiting = asyncio.create_task(table.take(4, timeout_s=5.0))
    await asyncio.sleep(0)
    table.offer(4, None)
    assert await waiting is None


async def test_a_room_is_one_handoff() -> None:
    table = RoomTable(hold_s=5.0)
    table.offer(5, SOURCE)
    table.offer(5, RemoteSource("engine-b", "req-2"))  # a second offer does not replace the first
    assert await table.take(5, timeout_s=0.01) == SOURCE
    first = asyncio.create_task(table.take(6, timeout_s=5.0))
    await asyncio.sleep(0)
    assert await table.take(6, timeout_s=5.0) is None  # a second decode of a room already waited on
    table.offer(6, SOURCE)
    assert await first == SOURCE


async def test_unpulled_offers_expire() -> None:
    table = RoomTable(hold_s=0.01)
    table.offer(7, SOURCE)
    await asyncio.sleep(0.05)
    assert not table.offers and table.expired == 1
    assert await table.take(7, timeout_s=0.01) is None


async def test_clear_fails_waiters_and_drops_offers() -> None:
    table = RoomTable(hold_s=5.0)
    table.offer(8, SOURCE)
    waiting = asyncio.create_task(table.take(9, timeout_s=5.0))
    await asyncio.sleep(0)
    table.clear()
    assert await waiting is None
    assert not table.offers and not table.waiters
