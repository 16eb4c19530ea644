"""One ZMQ subscription per replica, feeding the :class:`EventIngestor` from the router's asyncio loop.

Each :class:`KvEventSubscriber` owns a SUB socket connected to the replica's ``kv_events``
endpoint. ZMQ reconnects by itself with exponential backoff (``RECONNECT_IVL`` → ``RECONNECT_IVL_MAX``); on top of
that a liveness watch recreates the socket after ``idle_reconnect_s`` of silence, in case the peer went away without
the TCP connection noticing. Frames are ``[topic, seq, payload]`` (``[seq, payload]`` is tolerated); anything else is
counted as malformed and skipped, so a bad frame never stops the subscription.

On a gap the subscriber asks the replica's replay endpoint (a ROUTER) with a DEALER: it sends
``[b"", start_seq]`` and reads ``[b"", topic, seq, payload]`` (vLLM ≥0.26, SGLang ≥0.5.22) or
``[b"", seq, payload]`` (older) replies until the end marker (``seq == END_SEQ``), within ``replay_timeout_s``.
The replayed frames go through the same sequence rules. If there is no replay endpoint, it times out, or its
buffer no longer starts at the missing frame, the replica is purged and the stream resumes from the live frame.

An engine that restarted while its frames were being missed counts from 0 again and may be past the missing number
by the time a frame gets through: its replay buffer would then fill the gap with the new engine's frames, and
everything the old engine held would stay in the index for good. So when it can, the subscriber asks the replay from
the last frame it applied and checks that the engine sends back those very bytes (a batch carries its timestamp, so
two engines never publish the same payload); if not, the replica is reset under a new generation (reason
``replay_mismatch``) and the stream resumes from the live frame. Likewise a replay usually delivers frames the live
stream is still to deliver: those live copies must be the replayed bytes, else the engine restarted in between
(reason ``restart_after_replay``), which sequence numbers alone would take for duplicates.

A new subscription (kvgate started, restarted or scaled out while the engine was running) catches up from the
replay buffer from 0 at once, before any live frame, so every router agrees on what was published before it joined,
as far back as the engine's buffer goes, even while the engine is idle and publishes nothing. The replay ROUTER
answers a request from 0 with every buffered batch, or with the end marker alone when the buffer is empty; an
engine not up yet does not answer, and the subscription starts from its first live frame. A first live frame that
is not the engine's first, with nothing caught up before it, triggers the same catch-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Coroutine
from typing import Any, cast

import zmq
import zmq.asyncio

from kvgate.cache_index.ingest import ApplyResult, ApplyStatus, EventIngestor

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's end marker."""


def encode_seq(seq: int) -> bytes:
    """A sequence number as vLLM frames it: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


log = logging.getLogger(__name__)

_SEQ_BYTES = 8
DRAIN_BATCH = 64
"""Messages handled in a row before the loop gets a turn."""
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
"""As plain ints: ``EVENTS`` is asked on every wake-up, and the option and flag enums cost more than the call."""


class ReplayFailed(Exception):
    """The replay endpoint did not deliver the missing frames."""


class KvEventSubscriber:
    """Subscribes to one replica's (one DP rank's) KV-event stream and applies every frame to the ingestor."""

    def __init__(
        self,
        ingestor: EventIngestor,
        name: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        dp_rank: int | None = None,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        idle_reconnect_s: float = 30.0,
    ) -> None:
        self.ingestor = ingestor
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.dp_rank = dp_rank
        self.replay_timeout_s = replay_timeout_s
        self.idle_reconnect_s = idle_reconnect_s
        self.frames_received = 0
        self.malformed_frames = 0
        self.reconnects = 0
        self._last_applied: tuple[int, bytes] | None = None
        """The last frame applied, to check that a replay comes from the same engine instance."""
        self._replayed_through: int | None = None
        """The last sequence number a replay delivered, until the live stream goes past it."""
        self._replayed_ahead: dict[int, bytes] = {}
        """Digests of the frames a replay delivered that the live stream has not delivered yet (a catch-up from 0
        may hold a whole replay buffer)."""
        self._replayed_generation: int | None = None
        """The replica's generation when the replay was applied: once it moves (a reset, a restart seen elsewhere),
        the replay's frames say nothing about the live ones."""
        self._context = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None

    @property
    def last_applied(self) -> tuple[int, bytes] | None:
        """The last frame applied, (sequence number, payload)."""
        return self._last_applied

    def resume_after(self, seq: int, payload: bytes) -> None:
        """Continue after a frame applied before this subscription existed (another router's, with its index
        snapshot): a gap behind it is replayed from that frame, so the replay proves the same engine sent both."""
        self._last_applied = (seq, payload)

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events:{self.name}")
        return self._task

    def cancel(self) -> asyncio.Task[None] | None:
        """Ask the subscription to end; returns its task so a caller can await it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def stop(self) -> None:
        await _ended([self.cancel()])

    def _connect(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = zmq.Socket(self._context, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        return sock

    async def _run(self) -> None:
        sock = self._connect()  # before the catch-up: what the engine publishes meanwhile waits in the socket
        try:
            await self._join()
        except BaseException:
            sock.close(0)
            raise
        while True:
            await self._receive(sock)
            self.reconnects += 1
            sock = self._connect()

    async def _receive(self, sock: zmq.Socket[bytes]) -> None:
        """Receive on one SUB socket until it has been silent for ``idle_reconnect_s``, then close it.

        The socket is a plain one, read without waiting; the loop watches its file descriptor with one reader for the
        socket's life. A wake-up costs one future, where a ``zmq.asyncio`` receive costs a future, a timeout timer and
        a re-registration per message. ZMQ's descriptor only says that the socket's state may have changed, so every
        wake-up asks ``EVENTS`` (which also clears the signal) before anything is read."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop, sock, self.idle_reconnect_s)
        loop.add_reader(sock.FD, waiting.on_signal)
        try:
            while await waiting.readable():
                waiting.heard()
                await self._handle_queued(sock)
        finally:
            waiting.close()
            loop.remove_reader(sock.FD)
            sock.close(0)

    async def _handle_queued(self, sock: zmq.Socket[bytes]) -> None:
        """Handle every message queued in ``sock``, read without waiting (``EVENTS`` says when it is empty: cheaper
        than the exception an empty read raises). The loop gets a turn every ``DRAIN_BATCH`` messages."""
        handled = 0
        while _has_message(sock):
            frames = sock.recv_multipart(zmq.NOBLOCK)
            self.frames_received += 1
            try:
                await self.handle_frames(frames)
            except Exception:  # a bug on one frame must not end the subscription
                log.exception("kv-events %s: frame handling failed", self.name)
            handled += 1
            if handled % DRAIN_BATCH == 0:
                await asyncio.sleep(0)

    async def _join(self) -> None:
        """Catch up from the engine's replay buffer before the first live frame (the SUB socket is connected first,
        so what the engine publishes meanwhile waits in it and is checked against the replay). Counted as a replay
        only when the buffer held something."""
        if self.replay_endpoint is None or self._last_applied is not None \
                or self.ingestor.expected_seq(self.name, self.dp_rank) is not None:
            return
        try:
            replayed = await self._fetch_replay(0)
        except (ReplayFailed, zmq.ZMQError, TimeoutError) as exc:  # not up yet: its first live frame will do
            log.info("kv-events %s: no replay to catch up from at start (%r)", self.name, exc)
            return
        if not replayed:  # an empty buffer: nothing published yet
            return
        stats = self.ingestor.stats
        stats.replays_requested += 1
        try:
            self._apply_replayed(replayed, -1, None, self.ingestor.generation(self.name))
        except ReplayFailed as exc:
            stats.replays_failed += 1
            log.info("kv-events %s: could not catch up at start (%s)", self.name, exc)
            if self.ingestor.expected_seq(self.name, self.dp_rank) is not None:
                self.ingestor.purge(self.name, self.dp_rank)
        else:
            stats.replays_succeeded += 1

    async def handle_frames(self, frames: list[bytes]) -> ApplyResult | None:
        """Apply one live message; on a gap, repair it by replay or purge."""
        if len(frames) == 3:
            _, seq_frame, payload = frames
        elif len(frames) == 2:
            seq_frame, payload = frames
        else:
            self._malformed_frame(f"message of {len(frames)} frames")
            return None
        if len(seq_frame) != _SEQ_BYTES:
            self._malformed_frame(f"sequence frame of {len(seq_frame)} bytes")
            return None
        seq = int.from_bytes(seq_frame, "big")
        if self._replayed_through is not None:
            if self.ingestor.generation(self.name) == self._replayed_generation:
                self._check_replayed(seq, payload, self._replayed_through)
            else:
                self._replayed_through = None
                self._replayed_ahead.clear()
        if self._last_applied is None and seq > 0 and self.replay_endpoint is not None \
                and self.ingestor.expected_seq(self.name, self.dp_rank) is None:
            await self._catch_up(seq, payload)
            return None
        result = self.ingestor.apply(self.name, seq, payload, self.dp_rank)
        if result.applied:
            self._last_applied = (seq, payload)
        elif result.status is ApplyStatus.GAP:
            assert result.expected is not None
            await self._repair(result.expected, seq, payload)
        return result

    def _check_replayed(self, seq: int, payload: bytes, replayed_through: int) -> None:
        """A live frame at or before the replay's last one is the live copy of a replayed frame (the ingestor then
        discards it as a duplicate) or comes from an engine that restarted since: reset the replica."""
        if seq <= replayed_through:
            if self._replayed_ahead.pop(seq, None) == _digest(payload):
                return
            log.warning("kv-events %s: the engine restarted after a replay; resetting", self.name)
            self.ingestor.reset_replica(self.name, "restart_after_replay")
        self._replayed_through = None
        self._replayed_ahead.clear()

    def _malformed_frame(self, reason: str) -> None:
        self.malformed_frames += 1
        self.ingestor.malformed(self.name, reason)

    async def _repair(self, expected: int, live_seq: int, live_payload: bytes) -> None:
        stats = self.ingestor.stats
        generation = self.ingestor.generation(self.name)
        if self.replay_endpoint is not None:
            stats.replays_requested += 1
            anchor = self._last_applied if self._last_applied and self._last_applied[0] == expected - 1 else None
            try:
                replayed = await self._fetch_replay(expected if anchor is None else anchor[0])
                if anchor is not None and replayed and replayed[0][0] == anchor[0]:
                    if replayed[0][1] != anchor[1]:
                        stats.replays_failed += 1
                        log.warning("kv-events %s: the engine restarted behind a gap; resetting", self.name)
                        self.ingestor.reset_replica(self.name, "replay_mismatch")
                        self._apply_live(live_seq, live_payload)
                        return
                    replayed = replayed[1:]
                if not replayed or replayed[0][0] != expected:
                    raise ReplayFailed(f"replay starts at {replayed[0][0] if replayed else None}, need {expected}")
                self._apply_replayed(replayed, live_seq, live_payload, generation)
            except (ReplayFailed, zmq.ZMQError, TimeoutError) as exc:
                stats.replays_failed += 1
                log.warning("kv-events %s: replay from %d failed (%s); purging", self.name, expected, exc)
            else:
                stats.replays_succeeded += 1
                return
        self.ingestor.purge(self.name, self.dp_rank)
        self._apply_live(live_seq, live_payload)

    async def _catch_up(self, live_seq: int, live_payload: bytes) -> None:
        """Joining an engine that has been publishing for a while (kvgate started or scaled out after it): apply what
        its replay buffer still holds first, all of its history while the buffer has not wrapped, so this router
        agrees with routers that were subscribed all along. Blocks stored before the buffer's first frame stay
        unknown and their children are orphans: a miss, never a wrong hit."""
        stats = self.ingestor.stats
        stats.replays_requested += 1
        try:
            replayed = await self._fetch_replay(0)
            if not replayed:
                raise ReplayFailed("the replay buffer is empty")
            self._apply_replayed(replayed, live_seq, live_payload, self.ingestor.generation(self.name))
        except (ReplayFailed, zmq.ZMQError, TimeoutError) as exc:
            stats.replays_failed += 1
            log.info("kv-events %s: no history to catch up on (%s); starting from the live frame", self.name, exc)
            if self.ingestor.expected_seq(self.name, self.dp_rank) is not None:
                self.ingestor.purge(self.name, self.dp_rank)
            self._apply_live(live_seq, live_payload)
        else:
            stats.replays_succeeded += 1

    def _apply_replayed(
        self, replayed: list[tuple[int, bytes]], live_seq: int, live_payload: bytes | None, generation: int
    ) -> None:
        """Apply a replay's frames in order, then the live frame (if any) unless the replay already had it (its live
        copies are then checked as they arrive). Raises ReplayFailed when a frame does not follow or the replica moved on
        while the replay was fetched; a generation change a replayed frame makes itself (``AllBlocksCleared``) is
        followed, so what the engine stored after a cache reset is applied too."""
        for seq, payload in replayed:
            result = self.ingestor.apply(self.name, seq, payload, self.dp_rank, source="replay", generation=generation)
            if result.status in (ApplyStatus.GAP, ApplyStatus.STALE, ApplyStatus.UNKNOWN_REPLICA):
                raise ReplayFailed(f"replayed frame {seq}: {result.status.value}")
            if result.generation is not None:  # a replayed AllBlocksCleared starts the generation its successors join
                generation = result.generation
        self._last_applied = replayed[-1]
        self._replayed_through = replayed[-1][0]
        self._replayed_ahead = {seq: _digest(payload) for seq, payload in replayed if seq > live_seq}
        self._replayed_generation = generation
        if live_payload is not None and replayed[-1][0] < live_seq:
            self._apply_live(live_seq, live_payload)

    def _apply_live(self, seq: int, payload: bytes) -> None:
        if self.ingestor.apply(self.name, seq, payload, self.dp_rank).applied:
            self._last_applied = (seq, payload)

    async def _fetch_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every buffered ``(seq, payload)`` from ``start_seq`` on, read from the replay ROUTER until its end marker."""
        assert self.replay_endpoint is not None
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            frames: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self.replay_timeout_s):  # a DEALER's send waits until a peer is connected
                await sock.send_multipart([b"", encode_seq(start_seq)])
                while True:
                    reply = await sock.recv_multipart()
                    if len(reply) == 4:
                        _, _, seq_frame, payload = reply
                    elif len(reply) == 3:
                        _, seq_frame, payload = reply
                    else:
                        raise ReplayFailed(f"replay reply with {len(reply)} frames")
                    if seq_frame == END_SEQ:
                        return frames
                    if len(seq_frame) != _SEQ_BYTES:
                        raise ReplayFailed("replay reply with a bad sequence frame")
                    frames.append((int.from_bytes(seq_frame, "big"), payload))
        finally:
            sock.close(0)


class _Waiting:
    """A subscription waiting for its socket: woken by the socket's descriptor, or told it has been silent for
    ``idle_s`` by one timer re-armed only when it fires (never per message)."""

    __slots__ = ("loop", "sock", "idle_s", "last_heard", "waiter", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket[bytes], idle_s: float) -> None:
        self.loop = loop
        self.sock = sock
        self.idle_s = idle_s
        self.last_heard = loop.time()
        self.waiter: asyncio.Future[bool] | None = None
        self.timer = loop.call_at(self.last_heard + idle_s, self._check_idle)

    def heard(self) -> None:
        self.last_heard = self.loop.time()

    async def readable(self) -> bool:
        """True once a message can be read; False when the socket has been silent for ``idle_s``."""
        if _has_message(self.sock):
            return True
        if self.loop.time() - self.last_heard >= self.idle_s:
            return False
        self.waiter = self.loop.create_future()
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def on_signal(self) -> None:
        if _has_message(self.sock):
            self._wake(True)

    def _check_idle(self) -> None:
        due = self.last_heard + self.idle_s
        if self.loop.time() >= due:
            self._wake(False)
            due = self.loop.time() + self.idle_s
        self.timer = self.loop.call_at(due, self._check_idle)

    def _wake(self, readable: bool) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(readable)

    def close(self) -> None:
        self.timer.cancel()


class SubscriptionManager:
    """Starts and stops one :class:`KvEventSubscriber` per (replica, DP rank) on the running loop."""

    def __init__(
        self,
        ingestor: EventIngestor,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        idle_reconnect_s: float = 30.0,
    ) -> None:
        self.ingestor = ingestor
        self.replay_timeout_s = replay_timeout_s
        self.idle_reconnect_s = idle_reconnect_s
        self._context = context or zmq.asyncio.Context.instance()
        self._subscribers: dict[tuple[str, int | None], KvEventSubscriber] = {}

    def start(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int | None = None,
    ) -> KvEventSubscriber:
        """Subscribe (replacing an existing subscription of the same replica and rank if its endpoints changed)."""
        key = (name, dp_rank)
        current = self._subscribers.get(key)
        if current is not None:
            if (current.endpoint, current.replay_endpoint, current.topic) == (endpoint, replay_endpoint, topic):
                return current
            current.cancel()
        subscriber = KvEventSubscriber(
            self.ingestor,
            name,
            endpoint,
            replay_endpoint,
            topic,
            dp_rank=dp_rank,
            context=self._context,
            replay_timeout_s=self.replay_timeout_s,
            idle_reconnect_s=self.idle_reconnect_s,
        )
        self._subscribers[key] = subscriber
        subscriber.start()
        return subscriber

    def stop(self, name: str) -> Coroutine[Any, Any, None]:
        """Stop every subscription of a replica; await the result to wait until they have ended.

        They leave the manager and are cancelled at once, not when the coroutine first runs: a replica replaced in
        the same breath (a reload that changes its endpoints) gets a new subscription that this stop never touches.
        """
        tasks = [self._subscribers.pop(key).cancel() for key in [k for k in self._subscribers if k[0] == name]]
        return _ended(tasks)

    async def stop_all(self) -> None:
        for key in list(self._subscribers):
            await self._subscribers.pop(key).stop()

    def subscribers(self) -> list[KvEventSubscriber]:
        return list(self._subscribers.values())


def _has_message(sock: zmq.Socket[bytes]) -> bool:
    """Whether a whole message can be read from ``sock`` now. Asking also clears the signal on its descriptor."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def _digest(payload: bytes) -> bytes:
    """Identifies a frame's bytes (a batch carries its timestamp, so two engines never publish the same payload)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


async def _ended(tasks: list[asyncio.Task[None] | None]) -> None:
    for task in tasks:
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
