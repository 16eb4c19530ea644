"""The pure parts of kvgate's side of SGLang's P/D handoff: rooms, the bootstrap host, the two legs' bodies, and
what counts as a decode leg that worked."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvgate.router.apis.openai import CHAT
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.routing.handoff.sglang import (
    ROOM_MAX, Room, _succeeded, bootstrap_host, decode_leg_body, new_room, prefill_leg_body,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True,
        "stream_options": {"include_usage": True}}
ROOM = Room("10.0.0.5", 8998, 12345)


def test_rooms_are_in_sglangs_range_and_fresh() -> None:
    rooms = [new_room() for _ in range(2000)]
    assert all(0 <= r <= ROOM_MAX for r in rooms)
    assert len(set(rooms)) == len(rooms)
    assert max(rooms) > 2**62  # the whole 63-bit range, not a small one
    assert new_room(random.Random(1)) == new_room(random.Random(1))


@pytest.mark.parametrize("url, host", [
    ("http://10.0.0.5:8000", "10.0.0.5"),
    ("https://prefill-0.svc.cluster.local:30000/", "prefill-0.svc.cluster.local"),
    ("http://[fd00::5]:8000", "fd00::5"),
])
def test_bootstrap_host_is_the_replicas_host(url: str, host: str) -> None:
    assert bootstrap_host(url) == host


def test_decode_leg_is_the_clients_request_with_the_room() -> None:
    leg = decode_leg_body(BODY, ROOM)
    assert leg == {**BODY, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 12345}


def test_prefill_leg_is_read_whole() -> None:
    leg = prefill_leg_body(CHAT, BODY, ROOM)
    assert leg["stream"] is False and "stream_options" not in leg
    assert (leg["bootstrap_host"], leg["bootstrap_port"], leg["bootstrap_room"]) == ("10.0.0.5", 8998, 12345)
    assert leg["messages"] == BODY["messages"] and leg["max_tokens"] == 9
    assert BODY["stream"] is True  # the client's body is not touched


def upstream(status: int, first: bytes) -> Upstream:
    return Upstream("d0", SimpleNamespace(status=status), first, SimpleNamespace(), 1, 0.0, 0.0)  # type: ignore[arg-type]


def test_a_stream_opening_with_an_error_event_is_a_failed_decode_leg() -> None:
    assert _succeeded(upstream(200, b'data: {"id": "chatcmpl-1", "choices": [{"delta": {"content": "Hi"}}]}\n\n'))
    assert not _succeeded(upstream(200, b'data: {"error": {"message": "KVTransferError(bootstrap_room=7)"}}\n\n'))
    assert not _succeeded(upstream(500, b'{"error": {}}'))
    assert not _succeeded(None)
