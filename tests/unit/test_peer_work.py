"""Peers' dispatched work: each peer's latest report counts until its time-to-live, never past it, and a message
that is not a good report changes nothing."""

from __future__ import annotations

import math

import msgspec
import pytest

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.snapshot import pack_keys
from kvgate.router.fleet.state import NO_WORK, DispatchedWork
from kvgate.router.peers.hints import (
    MAX_HEARD_SENDERS, WARMING_FORMAT, WORK_FORMAT, Hint, HintExchange, Warming, Work,
)
from kvgate.router.fleet.peer_work import MAX_PREFILL_TOKENS, PeerWork
from kvgate.router.settings.schema import parse_config
from tests.support import ManualClock


def test_a_peers_share_counts_until_its_ttl_and_not_after() -> None:
    clock = ManualClock(1_000.0)
    work = PeerWork(1.0, clock)
    assert work.update("a", clock.now, {"r0": DispatchedWork(4000, 2, 3.0), "r1": DispatchedWork(0, 0, 0.5)})
    assert work.update("b", clock.now - 0.5, {"r0": DispatchedWork(1000, 1, 1.0)})
    assert work.work("r0") == (5000, 3, 4.0) and work.work("r1") == (0, 0, 0.5)
    clock.now += 0.6  # b's report is past its TTL: a lost peer's share is gone
    assert work.work("r0") == (4000, 2, 3.0) and work.peers() == 1
    clock.now += 0.5
    assert work.work("r0") == NO_WORK and work.peers() == 0


def test_a_newer_report_replaces_the_last_and_an_older_one_is_refused() -> None:
    clock = ManualClock(1_000.0)
    work = PeerWork(1.0, clock)
    assert work.update("a", clock.now, {"r0": DispatchedWork(4000, 2, 3.0)})
    assert not work.update("a", clock.now - 0.1, {"r0": DispatchedWork(9000, 9, 9.0)})  # reordered: newer stands
    assert work.work("r0") == (4000, 2, 3.0)
    assert work.update("a", clock.now + 0.01, {"r0": DispatchedWork(0, 0, 2.9)})  # its requests all decode now
    assert work.work("r0") == (0, 0, 2.9)
    assert work.update("a", clock.now + 0.02, {})  # it stopped sending there
    assert work.work("r0") == NO_WORK


@pytest.mark.parametrize("sent_at_offset, work", [
    (-1.5, DispatchedWork(10, 1, 1.0)),  # past its TTL on arrival
    (2.0, DispatchedWork(10, 1, 1.0)),  # from the future
    (0.0, DispatchedWork(-1, 1, 1.0)),
    (0.0, DispatchedWork(MAX_PREFILL_TOKENS, 1, 1.0)),
    (0.0, DispatchedWork(10, -3, 1.0)),
    (0.0, DispatchedWork(10, 1, -1.0)),
    (0.0, DispatchedWork(10, 1, math.nan)),
    (0.0, DispatchedWork(10, 1, math.inf)),
])
def test_a_stale_or_out_of_bounds_report_is_refused(sent_at_offset: float, work: DispatchedWork) -> None:
    clock = ManualClock(1_000.0)
    peers = PeerWork(1.0, clock)
    assert peers.update("a", clock.now, {"r1": DispatchedWork(5, 1, 1.0)})
    assert not peers.update("a", clock.now + 0.001 + sent_at_offset, {"r0": work})
    assert peers.work("r0") == NO_WORK and peers.work("r1") == (5, 1, 1.0)  # the report in force stands


def exchange(clock: ManualClock, work_ttl_s: float = 1.0) -> HintExchange:
    config = parse_config(f"peers: {{hints: {{work_ttl_s: {work_ttl_s}}}}}").peers
    return HintExchange(config, PrefixIndex(1000, 2.0), lambda name: name in ("r0", "r1"), "token", "me", clock=clock)


def encode(message: Hint | Work) -> bytes:
    return msgspec.msgpack.encode(message)


def test_received_work_counts_for_known_replicas_only_and_never_ones_own() -> None:
    clock = ManualClock(1_000.0)
    hints = exchange(clock)
    assert hints.apply(encode(Work(clock.now, "peer", [("r0", 800, 1, 2.0), ("elsewhere", 5, 1, 1.0)])))
    assert hints.work.work("r0") == (800, 1, 2.0) and hints.work.work("elsewhere") == NO_WORK
    assert not hints.apply(encode(Work(clock.now, "me", [("r1", 800, 1, 2.0)])))  # heard itself (DNS lists it too)
    assert hints.work.work("r1") == NO_WORK
    assert not hints.apply(encode(Work(clock.now - 5, "peer2", [("r1", 800, 1, 2.0)])))
    assert not hints.apply(b"\x93\x03\xcb")  # truncated
    assert hints.stats.work_applied == 1 and hints.stats.work_dropped == 1 and hints.stats.dropped == 1
    clock.now += 1.0
    assert hints.work.work("r0") == NO_WORK


def test_a_report_in_another_format_is_dropped() -> None:
    """A gateway of another version (a rolling upgrade) reports work in a format of its own: it is dropped, and
    routing goes on with this gateway's own view."""
    clock = ManualClock(1_000.0)
    hints = exchange(clock)
    assert not hints.apply(msgspec.msgpack.encode([WORK_FORMAT - 1, clock.now, "old", [["r0", 800, 1]]]))
    assert hints.work.work("r0") == NO_WORK and hints.stats.dropped == 1


def test_work_is_ignored_when_sharing_is_off() -> None:
    clock = ManualClock(1_000.0)
    hints = exchange(clock, work_ttl_s=0)
    assert not hints.apply(encode(Work(clock.now, "peer", [("r0", 800, 1, 2.0)])))
    assert hints.work.work("r0") == NO_WORK


def test_a_hint_from_oneself_is_not_credited_again() -> None:
    clock = ManualClock(1_000.0)
    hints = exchange(clock)
    keys = pack_keys([1, 2, 3])
    assert not hints.apply(encode(Hint(clock.now, "me", "r0", keys)))
    assert hints.stats.dropped == 0 and hints.stats.applied == 0


def test_a_peers_warming_reaches_replication_when_it_is_fresh_and_names_a_known_replica() -> None:
    clock = ManualClock(1_000.0)
    hints = exchange(clock)
    heard: list[tuple[int, str]] = []
    hints.on_peer_warming = lambda key, target: heard.append((key, target))
    key = (1 << 64) - 1
    assert hints.apply(encode(Warming(clock.now, "peer", "r0", key)))
    assert not hints.apply(encode(Warming(clock.now, "me", "r0", key)))  # its own
    assert not hints.apply(encode(Warming(clock.now, "peer", "elsewhere", key)))
    assert not hints.apply(encode(Warming(clock.now - 3, "peer", "r0", key)))  # older than the predicted TTL (2 s)
    assert not hints.apply(encode(Warming(clock.now, "peer", "r0", -1)))
    assert not hints.apply(msgspec.msgpack.encode([WARMING_FORMAT, clock.now, "peer", "r0", "p"]))
    assert heard == [(key, "r0")]
    assert hints.stats.applied == 1 and hints.stats.dropped == 4


def test_the_peers_heard_are_remembered_freshest_first_and_bounded() -> None:
    """What ``/admin/state`` lists of the peers: who was last heard from and when, only for messages taken in."""
    clock = ManualClock(1_000.0)
    hints = exchange(clock)
    assert hints.apply(encode(Hint(clock.now, "a", "r0", pack_keys([1, 2]))))
    clock.now += 0.5
    assert hints.apply(encode(Work(clock.now, "b", [("r0", 10, 1, 1.0)])))
    assert not hints.apply(encode(Hint(clock.now, "c", "elsewhere", pack_keys([1]))))  # dropped: not heard
    assert not hints.apply(encode(Hint(clock.now, "me", "r0", pack_keys([1]))))  # its own
    clock.now += 0.25
    assert hints.heard(8) == [("b", 0.25), ("a", 0.75)] and hints.heard_total() == 2
    assert hints.apply(encode(Warming(clock.now, "a", "r0", 7)))
    assert [sender for sender, _ in hints.heard(8)] == ["a", "b"]
    for i in range(MAX_HEARD_SENDERS + 10):
        hints.apply(encode(Hint(clock.now, f"peer-{i}", "r0", pack_keys([i + 1]))))
    assert hints.heard_total() == MAX_HEARD_SENDERS and len(hints.heard(5)) == 5
    assert hints.heard(1)[0][0] == f"peer-{MAX_HEARD_SENDERS + 9}"
    assert hints.subscribed() == []  # not started: subscribed to nothing
