"""The ZMQ subscriber against a real PUB socket and a real replay ROUTER, framed as vLLM frames them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.loadgen.sim.wire import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch, encode_seq
from tests.support import free_port_block, wait_until_async

pytestmark = pytest.mark.integration

BS = 4
TOKENS = list(range(300, 340))  # ten blocks, one per frame
DEADLINE_S = 5.0


def payload(block: int) -> bytes:
    parent = None if block == 0 else block
    event = BlockStored([block + 1], parent, TOKENS[block * BS : (block + 1) * BS], BS, None, "GPU", None)
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0))


def cleared_then(block: int) -> bytes:
    """vLLM's batch after ``/reset_prefix_cache``: ``AllBlocksCleared`` goes out with the next step's stores (here a
    fresh chain head: the reset forgot every parent)."""
    event = BlockStored([block + 1], None, TOKENS[:BS], BS, None, "GPU", None)
    return msgspec.msgpack.encode(
        KVEventBatch(ts=time.time(), events=[AllBlocksCleared(), event], data_parallel_rank=0))


def extends(block: int, parent: int) -> bytes:
    """A frame storing one block under ``parent`` (an engine hash), holding tokens block..block+1 of TOKENS."""
    event = BlockStored([block + 1], parent, TOKENS[BS : 2 * BS], BS, None, "GPU", None)
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0))


class FakeEngine:
    """A vLLM-shaped publisher: PUB ``[topic, seq, payload]`` and a replay ROUTER over its buffer, replying as
    vLLM ≥0.26 (``[b"", topic, seq, payload]``) or ≤0.24 (``[b"", seq, payload]``) does."""

    def __init__(self, context: zmq.asyncio.Context, port: int, *, topic_in_replay: bool = True) -> None:
        self.topic = b"kv"
        self.topic_in_replay = topic_in_replay
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{port + 1}"
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.replay_endpoint)
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self._replayer = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, seq: int, data: bytes, *, drop: bool = False) -> None:
        self.buffer[seq] = data
        if not drop:
            await self.pub.send_multipart([self.topic, encode_seq(seq), data])

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            topic = [self.topic] if self.topic_in_replay else []
            for seq in sorted(s for s in self.buffer if s >= start_seq):
                await self.router.send_multipart([identity, b"", *topic, encode_seq(seq), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", *([b""] if self.topic_in_replay else []), END_SEQ, b""])

    async def close(self) -> None:
        self._replayer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._replayer
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[zmq.asyncio.Context, PrefixIndex, EventIngestor, SubscriptionManager]]:
    context = zmq.asyncio.Context()
    index = PrefixIndex()
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    manager = SubscriptionManager(ingestor, context=context, replay_timeout_s=1.0)
    try:
        yield context, index, ingestor, manager
    finally:
        await manager.stop_all()
        context.destroy(linger=0)


def held_tokens(index: PrefixIndex) -> int:
    match = index.lookup(block_keys(namespace_key("m"), TOKENS, BS), BS).get("r")
    return 0 if match is None else match.total


async def connect(engine: FakeEngine, ingestor: EventIngestor, *, replay: bool = True) -> None:
    """Publish frame 0 until the subscription is live (ZMQ drops PUB messages sent before a SUB has joined); with
    ``replay``, once the subscription has caught up from the (still empty) replay buffer at its start."""
    deadline = time.monotonic() + DEADLINE_S
    if replay:
        await wait_until_async(lambda: engine.replay_requests == [0], "the catch-up at the subscription's start")
        engine.replay_requests.clear()
    while ingestor.expected_seq("r") != 1:
        assert time.monotonic() < deadline, "subscriber never received frame 0"
        await engine.publish(0, payload(0))
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("topic_in_replay", [True, False], ids=["vllm-0.26+", "vllm-0.24-"])
async def test_live_frames_apply_and_a_dropped_frame_is_repaired_by_replay(fleet, topic_in_replay: bool) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2), topic_in_replay=topic_in_replay)
    try:
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.publish(1, payload(1))
        await engine.publish(2, payload(2), drop=True)
        await engine.publish(3, payload(3))
        for seq in range(4, 10):
            await engine.publish(seq, payload(seq))
        await wait_until_async(lambda: held_tokens(index) == len(TOKENS), "all ten blocks")
        assert engine.replay_requests == [1]  # from the last frame applied, to check it is the same engine
        assert ingestor.stats.gaps_detected == 1
        assert ingestor.stats.replays_succeeded == 1 and ingestor.stats.purges == 0
    finally:
        await engine.close()


async def test_replay_that_no_longer_covers_the_gap_purges(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.publish(1, payload(1))
        await engine.publish(2, payload(2), drop=True)
        del engine.buffer[2]  # fell out of the engine's replay buffer
        await engine.publish(3, payload(3))
        await wait_until_async(lambda: ingestor.expected_seq("r") == 4, "frame 3")
        assert engine.replay_requests == [1]
        assert ingestor.stats.replays_failed == 1 and ingestor.stats.purges == 1
        assert held_tokens(index) == 0  # block 3's parent was purged: nothing is guessed
    finally:
        await engine.close()


async def test_an_engine_restarted_behind_a_gap_is_reset_not_replayed_into_the_old_generation(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.publish(1, payload(1))
        await wait_until_async(lambda: held_tokens(index) == 8, "two blocks")
        engine.buffer.clear()  # restarted: counts from 0 again, and kvgate misses every frame up to seq 4
        empty = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[]))
        for seq in range(4):
            await engine.publish(seq, empty, drop=True)
        await engine.publish(4, empty)
        await wait_until_async(lambda: ingestor.expected_seq("r") == 5, "frame 4")
        assert engine.replay_requests == [1]
        assert ingestor.stats.replays_failed == 1 and ingestor.stats.resets["replay_mismatch"] == 1
        assert ingestor.generation("r") == 1 and held_tokens(index) == 0
    finally:
        await engine.close()


async def test_an_engine_restarted_right_after_a_replay_is_not_taken_for_duplicates(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.publish(1, payload(1))
        await wait_until_async(lambda: held_tokens(index) == 8, "two blocks")
        await engine.publish(2, payload(2), drop=True)
        await engine.publish(3, payload(3))
        await wait_until_async(lambda: held_tokens(index) == 16, "four blocks, the third one replayed")
        engine.buffer.clear()  # restarted: its frame 0 reuses a number the replay already covered
        await engine.publish(0, msgspec.msgpack.encode(
            KVEventBatch(ts=time.time(), events=[BlockStored([100], None, TOKENS[:4], BS, None, "GPU", None)])))
        await wait_until_async(lambda: ingestor.generation("r") == 1, "the restart")
        assert ingestor.stats.resets["restart_after_replay"] == 1 and ingestor.stats.dropped["duplicate"] == 0
        assert held_tokens(index) == 4
    finally:
        await engine.close()


async def test_without_replay_a_gap_purges_and_the_index_rebuilds_from_new_frames(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        subscriber = manager.start("r", engine.endpoint, None, topic="kv")
        await connect(engine, ingestor, replay=False)
        await engine.publish(1, payload(1))
        await wait_until_async(lambda: held_tokens(index) == 8, "two blocks")
        await engine.publish(2, payload(2), drop=True)
        await engine.publish(3, payload(3))  # orphan after the purge: its parent was forgotten
        restarted_chain = msgspec.msgpack.encode(
            KVEventBatch(ts=1.0, events=[BlockStored([100, 101], None, TOKENS[:8], BS, None, "GPU", None)])
        )
        await engine.publish(4, restarted_chain)
        await wait_until_async(lambda: ingestor.expected_seq("r") == 5, "frame 4")
        assert ingestor.stats.purges == 1 and ingestor.stats.replays_requested == 0
        assert ingestor.stats.dropped["orphan"] == 1
        assert held_tokens(index) == 8
        assert subscriber.malformed_frames == 0
    finally:
        await engine.close()


async def test_bad_frames_are_counted_and_never_stop_the_subscription(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        subscriber = manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.pub.send_multipart([b"kv", b"short", payload(1)])
        await engine.pub.send_multipart([b"kv", b"a", b"b", b"c"])
        await engine.pub.send_multipart([b"kv", encode_seq(1), b"\xc1 not msgpack"])
        await engine.publish(2, payload(0))
        await wait_until_async(lambda: ingestor.expected_seq("r") == 3, "frame 2")
        assert subscriber.malformed_frames == 2
        assert ingestor.stats.dropped["malformed"] == 3
        assert held_tokens(index) == 4
    finally:
        await engine.close()


async def test_a_silent_stream_is_reconnected_and_keeps_working(fleet) -> None:
    context, index, ingestor, _ = fleet
    manager = SubscriptionManager(ingestor, context=context, idle_reconnect_s=0.1)
    engine = FakeEngine(context, free_port_block(2))
    try:
        subscriber = manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        assert manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv") is subscriber
        await connect(engine, ingestor)
        await wait_until_async(lambda: subscriber.reconnects >= 2, "two idle reconnects")
        # a fresh SUB socket needs a moment to join again: keep publishing (empty) frames; one that arrives after
        # frame 1 was missed is a gap that replay repairs
        await engine.publish(1, payload(1))
        empty = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[]))
        seq = 2
        deadline = time.monotonic() + DEADLINE_S
        while (ingestor.expected_seq("r") or 0) < 2:
            assert time.monotonic() < deadline, "nothing arrived after reconnecting"
            await engine.publish(seq, empty)
            seq += 1
            await asyncio.sleep(0.02)
        assert held_tokens(index) == 8
    finally:
        await manager.stop_all()
        await engine.close()


async def test_a_replica_stopped_and_subscribed_again_at_once_keeps_its_new_subscription(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        old = manager.start("r", engine.endpoint, None, topic="kv")
        stopping = manager.stop("r")  # as a listener does: the coroutine runs later, on its own task
        new = manager.start("r", engine.endpoint, None, topic="kv")
        await stopping
        assert new is not old and manager.subscribers() == [new]
        await connect(engine, ingestor, replay=False)
        assert held_tokens(index) == 4
    finally:
        await engine.close()


async def test_joining_an_idle_engine_catches_up_at_once(fleet) -> None:
    """An engine that published before kvgate subscribed and has been idle since: its history is applied from the
    replay buffer when the subscription starts, without waiting for a live frame."""
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        for seq in range(4):
            await engine.publish(seq, payload(seq), drop=True)
        subscriber = manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await wait_until_async(lambda: held_tokens(index) == 16, "the history, with no live frame")
        assert engine.replay_requests == [0] and ingestor.expected_seq("r") == 4
        assert ingestor.stats.replays_succeeded == 1 and subscriber.frames_received == 0
        deadline = time.monotonic() + DEADLINE_S
        while ingestor.expected_seq("r") == 4:  # the live stream goes on from there (once the SUB has joined)
            assert time.monotonic() < deadline, "no live frame arrived"
            await engine.publish(4, payload(4))
            await asyncio.sleep(0.02)
        assert held_tokens(index) == 20 and ingestor.stats.purges == 0 and ingestor.stats.gaps_detected == 0
    finally:
        await engine.close()


async def test_joining_a_running_engine_catches_up_from_its_replay_buffer(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        for seq in range(4):
            await engine.publish(seq, payload(seq), drop=True)  # published before anyone subscribed
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        seq = 4
        deadline = time.monotonic() + DEADLINE_S
        while ingestor.expected_seq("r") is None:  # until the SUB has joined
            assert time.monotonic() < deadline, "no live frame arrived"
            await engine.publish(seq, payload(seq))
            seq += 1
            await asyncio.sleep(0.02)
        await wait_until_async(lambda: held_tokens(index) >= 20, "the history and the live frame")
        assert engine.replay_requests == [0]
        assert ingestor.stats.replays_succeeded == 1 and ingestor.stats.purges == 0
    finally:
        await engine.close()


async def test_catching_up_across_a_cache_reset_applies_what_followed_it(fleet) -> None:
    """The replay from 0 carries the reset's AllBlocksCleared: the frames after it belong to the new generation."""
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        for seq in range(3):
            await engine.publish(seq, payload(seq), drop=True)
        await engine.publish(3, cleared_then(50), drop=True)
        await engine.publish(4, extends(60, parent=51), drop=True)
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        seq = 5
        deadline = time.monotonic() + DEADLINE_S
        while ingestor.expected_seq("r") is None:  # until the SUB has joined
            assert time.monotonic() < deadline, "no live frame arrived"
            await engine.publish(seq, msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[])))
            seq += 1
            await asyncio.sleep(0.02)
        await wait_until_async(lambda: held_tokens(index) == 2 * BS, "the two blocks stored after the reset")
        assert engine.replay_requests == [0]
        assert ingestor.stats.replays_succeeded == 1 and ingestor.stats.replays_failed == 0
        assert ingestor.stats.purges == 0 and ingestor.generation("r") == 1
    finally:
        await engine.close()


async def test_a_gap_repaired_across_a_cache_reset_applies_what_followed_it(fleet) -> None:
    context, index, ingestor, manager = fleet
    engine = FakeEngine(context, free_port_block(2))
    try:
        manager.start("r", engine.endpoint, engine.replay_endpoint, topic="kv")
        await connect(engine, ingestor)
        await engine.publish(1, payload(1))
        await wait_until_async(lambda: held_tokens(index) == 2 * BS, "two blocks")
        await engine.publish(2, cleared_then(50), drop=True)
        await engine.publish(3, extends(60, parent=51), drop=True)
        await engine.publish(4, msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[])))
        await wait_until_async(lambda: ingestor.expected_seq("r") == 5, "frame 4")
        assert held_tokens(index) == 2 * BS  # the new generation's two blocks, not the old one's
        assert ingestor.stats.replays_succeeded == 1 and ingestor.stats.replays_failed == 0
        assert ingestor.stats.purges == 0 and ingestor.generation("r") == 1
    finally:
        await engine.close()


async def test_an_unreachable_replay_endpoint_times_out_and_purges(fleet) -> None:
    context, index, ingestor, _ = fleet
    manager = SubscriptionManager(ingestor, context=context, replay_timeout_s=0.2)
    engine = FakeEngine(context, free_port_block(3))
    nobody = f"tcp://127.0.0.1:{int(engine.endpoint.rsplit(':', 1)[1]) + 2}"
    try:
        manager.start("r", engine.endpoint, nobody, topic="kv")
        await connect(engine, ingestor, replay=False)
        await engine.publish(2, payload(2))
        await wait_until_async(lambda: ingestor.expected_seq("r") == 3, "frame 2 after the failed replay")
        assert ingestor.stats.replays_requested == 1 and ingestor.stats.replays_failed == 1
        assert ingestor.stats.purges == 1
        assert held_tokens(index) == 0
    finally:
        await manager.stop_all()
        await engine.close()
