"""Peers' dispatched prefill work: each peer's latest report counts until its time-to-live, never past it, and a
message that is not a good report changes nothing."""

from __future__ import annotations

import msgspec
import pytest

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.snapshot import pack_keys
from kvgate.router.config import parse_config
from kvgate.router.peers.hints import Hint, HintExchange, Work
from kvgate.router.peers.work import MAX_PREFILL_TOKENS, PeerWork


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_a_peers_share_counts_until_its_ttl_and_not_after() -> None:
    clock = Clock()
    work = PeerWork(1.0, clock)
    assert work.update("a", clock.now, {"r0": (4000, 2), "r1": (0, 0)})
    assert work.update("b", clock.now - 0.5, {"r0": (1000, 1)})
    assert work.prefill("r0") == (5000, 3) and work.prefill("r1") == (0, 0)
    clock.now += 0.6  # b's report is past its TTL: a lost peer's share is gone
    assert work.prefill("r0") == (4000, 2) and work.peers() == 1
    clock.now += 0.5
    assert work.prefill("r0") == (0, 0) and work.peers() == 0


def test_a_newer_report_replaces_the_last_and_an_older_one_is_refused() -> None:
    clock = Clock()
    work = PeerWork(1.0, clock)
    assert work.update("a", clock.now, {"r0": (4000, 2)})
    assert not work.update("a", clock.now - 0.1, {"r0": (9000, 9)})  # reordered: the newer report stands
    assert work.prefill("r0") == (4000, 2)
    assert work.update("a", clock.now + 0.01, {})  # its requests all produced a first token
    assert work.prefill("r0") == (0, 0)


@pytest.mark.parametrize("sent_at_offset, loads", [
    (-1.5, {"r0": (10, 1)}),  # past its TTL on arrival
    (2.0, {"r0": (10, 1)}),  # from the future
    (0.0, {"r0": (-1, 1)}),
    (0.0, {"r0": (MAX_PREFILL_TOKENS, 1)}),
    (0.0, {"r0": (10, -3)}),
])
def test_a_stale_or_out_of_bounds_report_is_refused(sent_at_offset: float, loads: dict[str, tuple[int, int]]) -> None:
    clock = Clock()
    work = PeerWork(1.0, clock)
    assert not work.update("a", clock.now + sent_at_offset, loads)
    assert work.prefill("r0") == (0, 0)


def exchange(clock: Clock, work_ttl_s: float = 1.0) -> HintExchange:
    config = parse_config(f"peers: {{hints: {{work_ttl_s: {work_ttl_s}}}}}").peers
    return HintExchange(config, PrefixIndex(1000, 2.0), lambda name: name in ("r0", "r1"), "token", "me", clock=clock)


def encode(message: Hint | Work) -> bytes:
    return msgspec.msgpack.encode(message)


def test_received_work_counts_for_known_replicas_only_and_never_ones_own() -> None:
    clock = Clock()
    hints = exchange(clock)
    assert hints.apply(encode(Work(clock.now, "peer", [("r0", 800, 1), ("elsewhere", 5, 1)])))
    assert hints.peer_prefill("r0") == (800, 1) and hints.peer_prefill("elsewhere") == (0, 0)
    assert not hints.apply(encode(Work(clock.now, "me", [("r1", 800, 1)])))  # heard itself (DNS lists it too)
    assert hints.peer_prefill("r1") == (0, 0)
    assert not hints.apply(encode(Work(clock.now - 5, "peer2", [("r1", 800, 1)])))
    assert not hints.apply(b"\x93\x03\xcb")  # truncated
    assert hints.stats.work_applied == 1 and hints.stats.work_dropped == 1 and hints.stats.dropped == 1
    clock.now += 1.0
    assert hints.peer_prefill("r0") == (0, 0)


def test_work_is_ignored_when_sharing_is_off() -> None:
    clock = Clock()
    hints = exchange(clock, work_ttl_s=0)
    assert not hints.apply(encode(Work(clock.now, "peer", [("r0", 800, 1)])))
    assert hints.peer_prefill("r0") == (0, 0)


def test_a_hint_from_oneself_is_not_credited_again() -> None:
    clock = Clock()
    hints = exchange(clock)
    keys = pack_keys([1, 2, 3])
    assert not hints.apply(encode(Hint(clock.now, "me", "r0", keys)))
    assert hints.stats.dropped == 0 and hints.stats.applied == 0
