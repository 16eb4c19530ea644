"""vLLM's ZMQ KV-event publisher (``ZmqEventPublisher``, 0.26+ framing) for one replica.

PUB frames ``[topic, seq (8-byte big-endian, from 0), msgpack KVEventBatch]``, one per scheduler step with events.
The ROUTER replay socket answers ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]`` for every
buffered batch with seq >= start, then the end marker ``[identity, b"", b"", END_SEQ, b""]``.
Faults act here: dropped frames consume their seq and stay replayable; delayed frames keep their order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from .wire import END_SEQ, KVEventBatch, encode_seq

log = logging.getLogger(__name__)

Frame = tuple[bytes, bytes, bytes]


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_endpoint: str,
        replay_endpoint: str,
        topic: str,
        buffer_steps: int,
        rng: random.Random,
    ) -> None:
        self.topic = topic.encode("utf-8")
        self.rng = rng
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(pub_endpoint)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(replay_endpoint)
        self.buffer: deque[tuple[int, Frame]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.drop_fraction = 0.0
        self.delay_s = 0.0
        self.replay_enabled = True
        self.frames_sent = 0
        self.frames_dropped = 0
        self.replay_requests = 0
        self.replay_invalid = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: asyncio.Queue[tuple[float, Frame]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._replay_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pub.close(0)
        self.replay.close(0)

    def publish(self, events: list) -> None:
        """Publish one step's events as one batch (vLLM sets ``data_parallel_rank`` to the engine's DP rank, 0)."""
        seq = self.next_seq
        self.next_seq += 1
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        frame: Frame = (self.topic, encode_seq(seq), payload)
        self.buffer.append((seq, frame))
        if self.drop_fraction > 0 and self.rng.random() < self.drop_fraction:
            self.frames_dropped += 1
            return
        self._outbox.put_nowait((time.monotonic() + self.delay_s, frame))

    def reset(self) -> None:
        """An engine restart: seq back to 0, replay buffer and unsent frames gone."""
        self.next_seq = 0
        self.buffer.clear()
        while not self._outbox.empty():
            self._outbox.get_nowait()

    async def _send_loop(self) -> None:
        while True:
            due, frame = await self._outbox.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.pub.send_multipart(frame, copy=False)
            self.frames_sent += 1

    async def _replay_loop(self) -> None:
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.replay_invalid += 1
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            if not self.replay_enabled:
                continue
            self.replay_requests += 1
            try:
                await self._answer_replay(frames[0], int.from_bytes(frames[2], "big"))
            except zmq.ZMQError as e:  # a client gone mid-answer must not end replay for everyone
                log.warning("replay answer failed: %s", e)

    async def _answer_replay(self, identity: bytes, start: int) -> None:
        for seq, (topic, seq_bytes, payload) in list(self.buffer):
            if seq >= start:
                await self.replay.send_multipart([identity, b"", topic, seq_bytes, payload], copy=False)
        await self.replay.send_multipart([identity, b"", b"", END_SEQ, b""])
