"""The per-replica state machine that turns engine KV-event frames into index holdings (no sockets here).

Sequence rules, per (replica, DP rank) stream:

- the first sequence number seen is accepted, whatever it is;
- ``seq == expected``: applied;
- ``seq > expected``: a gap. Nothing is applied (neither this frame nor later ones) until the caller repairs the gap
  by feeding the missing frames (replay) or gives up and calls :meth:`EventIngestor.purge`;
- ``seq < expected``: either a frame seen before, discarded (never applied twice), or an engine restart (every
  publisher counts from 0): the replica's generation is bumped, everything it held is dropped and the frame is
  applied. ZMQ PUB/SUB never delivers a frame twice, so on a live stream (``source="zmq"``) the only duplicates are
  live frames that a replay already delivered, and any other step back is a restart, even if the restarted engine's
  first frames were missed. Over HTTP (retries) and replay, ``seq == 0`` or a step back of more than
  ``duplicate_window`` is a restart and anything closer is a duplicate.

Generations: every restart, ``AllBlocksCleared``, reset (health loss, drain) or namespace change bumps the
replica's generation and drops all its holdings.

Restarts the sequence cannot show (the new engine's first frames were missed, or it has published nothing yet) are
reported by the router from the engine's scraped process start time (:meth:`EventIngestor.engine_started`): unless
the current generation already began with that engine's own frames, the generation is bumped. From then on a frame
whose batch timestamp predates the process start (published by the old engine, still in flight) is stale: the
timestamp and the start time both come from the engine host's clock. A caller that captured a generation before
awaiting something (a replay) passes it back, and frames of an older generation are discarded as stale.

Keys: a ``BlockStored`` chain with no parent is rooted at the namespace of (replica's model, weight version, cache
salt, LoRA name); the salt is SGLang's ``cache_salt`` field or the bare string vLLM publishes in block 0's extra keys
(any string there that is not the LoRA name). Other extra keys (multimodal ids, embeds digests) fold into the block
keys, so such blocks never match text-only requests. A stored chain whose parent hash is unknown is skipped and
counted as orphan: kvgate never guesses a prefix. ``BlockRemoved`` resolves engine hashes through the replica's
engine-hash → key map; a hash leaves the map once the replica holds its block in no tier.

A malformed frame is counted, logged (at most once per ``MALFORMED_LOG_INTERVAL_S`` per replica, with the reason and
how many went unlogged) and otherwise ignored. It keeps its place in the sequence, so it never opens a gap and never
erases what the replica holds: bytes anyone can send must not wipe good state. Only a sequence number proving a gap
leads to a purge (when replay cannot repair it).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgate.cache_index.events import Cleared, DecodedBatch, MalformedBatch, Removed, Stored, decode_batch
from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import Tier, tier_of_medium

log = logging.getLogger(__name__)

DEFAULT_DUPLICATE_WINDOW = 100_000
"""Over HTTP and replay: how far back a sequence number may be and still count as a duplicate, not a restart."""

MALFORMED_LOG_INTERVAL_S = 10.0
"""At most one log line per replica per this many seconds about malformed frames and events."""
RESTART_RESETS = frozenset({"replay_mismatch", "restart_after_replay"})
"""Reset reasons that are an engine restart the subscriber saw in the stream itself."""
RESTART_CLOCK_MARGIN_S = 1.0
"""prometheus_client computes a process start time from the host's boot time in whole seconds, so the scraped value
may be up to a second early: a generation counts as the restarted engine's own when its first frame is this much
later than the scraped start (or is the new engine's sequence restart itself)."""
_REASON_CHARS = 200
"""A logged reason is cut to this length: it may quote bytes anyone sent."""

_FULL_ATTENTION = (None, "full_attention")
_GPU_MEDIA = {None: Tier.GPU, "GPU": Tier.GPU}
"""The media nearly every event carries, looked up without a call."""


class ApplyStatus(enum.Enum):
    APPLIED = "applied"
    RESTARTED = "restarted"
    """Sequence went backwards: generation bumped, old holdings dropped, frame applied."""
    DUPLICATE = "duplicate"
    STALE = "stale"
    GAP = "gap"
    MALFORMED = "malformed"
    UNKNOWN_REPLICA = "unknown_replica"


@dataclass(slots=True, frozen=True)
class ApplyResult:
    status: ApplyStatus
    expected: int | None = None
    """For a gap: the first missing sequence number."""
    got: int | None = None
    """For a gap: the sequence number received."""
    events: int = 0
    """Events applied from this frame."""
    generation: int | None = None
    """The replica's generation once the frame was handled: a frame carrying ``AllBlocksCleared`` moves it on, and a
    caller applying further frames of the same engine (a replay) passes this one along, not the one it started with."""

    @property
    def applied(self) -> bool:
        return self.status in (ApplyStatus.APPLIED, ApplyStatus.RESTARTED)


DROP_REASONS = (
    "stale_generation", "duplicate", "malformed", "unknown_type", "orphan", "unknown_medium", "other_kv_group",
    "unknown_replica",
)
"""Every reason an event or frame is not applied (``IngestStats.dropped``), exported as metrics from the start."""


@dataclass(slots=True)
class IngestStats:
    """Plain counters the router exports as metrics."""

    events_applied: int = 0
    frames_applied: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    """Events or frames not applied, by reason (one of ``DROP_REASONS``)."""
    unknown_fields: int = 0
    unknown_removed: int = 0
    """Removed hashes kvgate never saw stored (e.g. stored before it subscribed): nothing to do."""
    gaps_detected: int = 0
    replays_requested: int = 0
    replays_succeeded: int = 0
    replays_failed: int = 0
    purges: int = 0
    restarts: int = 0
    resets: Counter[str] = field(default_factory=Counter)
    generations: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StreamCounts:
    """One replica's frames (and events, for ``malformed`` and ``orphans``) by fate, over every generation: its share of
    :class:`IngestStats`, for the operator."""

    frames_applied: int = 0
    replayed: int = 0
    """Frames applied from the engine's replay buffer (repairing a gap, or catching up on joining)."""
    gaps: int = 0
    duplicates: int = 0
    stale: int = 0
    malformed: int = 0
    orphans: int = 0
    """Stored chains whose parent was never seen: skipped, a miss later."""
    purges: int = 0
    restarts: int = 0


@dataclass(slots=True)
class _Stream:
    expected: int | None = None
    gap: tuple[int, int] | None = None
    replayed_through: int | None = None
    """Last sequence number a replay applied, until the live stream catches up with it."""


@dataclass(slots=True)
class _Replica:
    model: str
    weight_version: str
    block_size: int | None
    generation: int
    streams: dict[int | None, _Stream] = field(default_factory=dict)
    started_at: float | None = None
    """The engine process's start time (epoch seconds) once a restart was reported: older batches are stale."""
    first_ts: float | None = None
    """Timestamp of the first batch applied in the current generation."""
    by_restart: bool = False
    """The current generation began with a restart seen in the event stream (its sequence went back, or the
    subscriber found a replay or a live frame another engine's): its frames are the new engine's."""
    began_knowing: float | None = None
    """The engine start time already reported when the current generation began: every frame it applied is no older
    than that start (older ones are stale), so they are that process's own."""
    engine_keys: dict[int, int] = field(default_factory=dict)
    namespaces: dict[tuple[str | None, str | None], int] = field(default_factory=dict)
    counts: StreamCounts = field(default_factory=StreamCounts)
    last_frame_at: float | None = None
    """When the ingestor was last handed a frame of this replica (its clock), whatever became of it."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where one replica's event streams stand in a router: what another router needs to continue them from there
    (its holdings travel apart, see :mod:`cache_index.snapshot`)."""

    model: str
    weight_version: str
    block_size: int | None
    first_ts: float | None
    by_restart: bool
    expected: dict[int | None, int]
    """Per DP rank: the next sequence number the stream expects."""
    engine_keys: dict[int, int]
    """Engine block hash → kvgate key, for the blocks the replica holds."""


class EventIngestor:
    """Applies KV-event frames of many replicas to one :class:`PrefixIndex`, enforcing the sequence rules."""

    def __init__(
        self, index: PrefixIndex, *, duplicate_window: int = DEFAULT_DUPLICATE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.duplicate_window = duplicate_window
        self.clock = clock
        self.stats = IngestStats()
        self._replicas: dict[str, _Replica] = {}
        self._retired_generations: dict[str, int] = {}
        """Last generation of removed replicas, so a re-added one never reuses a generation."""
        self._malformed_logged: dict[str, tuple[float, int]] = {}
        """Per replica: when a malformed frame was last logged, and how many were counted since without a line."""

    # replica lifecycle

    def add_replica(self, name: str, *, model: str, weight_version: str = "") -> None:
        """Start tracking a replica (or update one): its model and weight version root its namespaces."""
        replica = self._replicas.get(name)
        if replica is not None:
            self.set_namespace(name, model, weight_version)
            return
        generation = self._retired_generations.pop(name, -1) + 1
        self._replicas[name] = _Replica(model, weight_version, None, generation)
        self.stats.generations[name] = generation
        self.index.reset_replica(name, generation)  # the index reports every tracked replica's generation

    def set_namespace(self, name: str, model: str, weight_version: str = "") -> None:
        """A new model or weight version: nothing held so far can match, so drop it all under a new generation."""
        replica = self._replicas[name]
        if (replica.model, replica.weight_version) == (model, weight_version):
            return
        replica.model, replica.weight_version = model, weight_version
        replica.namespaces.clear()
        self._bump(name, replica, clear_streams=False)
        self.stats.resets["namespace"] += 1

    def remove_replica(self, name: str) -> None:
        replica = self._replicas.pop(name, None)
        if replica is not None:
            self.index.forget_replica(name)
            self._retired_generations[name] = replica.generation
            del self.stats.generations[name]

    def reset_replica(self, name: str, reason: str) -> None:
        """Health loss, drain, restart seen elsewhere: forget everything and start a new generation."""
        replica = self._replicas.get(name)
        if replica is None:
            return
        self._bump(name, replica, clear_streams=True, restart=reason in RESTART_RESETS)
        self.stats.resets[reason] += 1

    def purge(self, name: str, dp_rank: int | None = None) -> None:
        """A gap could not be repaired: drop the replica's holdings and resume the stream at its next frame."""
        replica = self._replicas.get(name)
        if replica is None:
            return
        self.index.drop_replica(name)
        replica.engine_keys.clear()
        replica.streams[dp_rank] = _Stream()
        self.stats.purges += 1
        replica.counts.purges += 1

    def generation(self, name: str) -> int:
        return self._replicas[name].generation

    def block_size(self, name: str) -> int | None:
        """The block size of the replica's latest ``BlockStored`` (None before its first one, or for an unknown
        replica): what its holdings' keys were computed with, so what a request's keys must use to match them."""
        replica = self._replicas.get(name)
        return None if replica is None else replica.block_size

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def stream_state(self, name: str, max_streams: int) -> dict[str, object] | None:
        """Where ``name``'s event streams stand, counted: its generation and block size, how long since its last
        frame, its frames by fate (:class:`StreamCounts`), and per DP rank (at most ``max_streams`` of them) the last
        sequence number taken and any gap being repaired. None for a replica not tracked."""
        replica = self._replicas.get(name)
        if replica is None:
            return None
        ranks = sorted(replica.streams.items(), key=lambda item: -1 if item[0] is None else item[0])
        last = replica.last_frame_at
        return {
            "generation": replica.generation, "block_size": replica.block_size,
            "last_frame_age_s": None if last is None else round(self.clock() - last, 3),
            "counts": asdict(replica.counts), "streams_total": len(ranks),
            "streams": [{"dp_rank": rank, "last_seq": None if s.expected is None else s.expected - 1,
                         "gap": list(s.gap) if s.gap else None} for rank, s in ranks[:max_streams]],
        }

    def expected_seq(self, name: str, dp_rank: int | None = None) -> int | None:
        replica = self._replicas.get(name)
        stream = None if replica is None else replica.streams.get(dp_rank)
        return None if stream is None else stream.expected

    def resume_point(self, name: str) -> ResumePoint | None:
        replica = self._replicas.get(name)
        if replica is None:
            return None
        expected = {rank: s.expected for rank, s in replica.streams.items() if s.expected is not None}
        return ResumePoint(replica.model, replica.weight_version, replica.block_size, replica.first_ts,
                           replica.by_restart, expected, dict(replica.engine_keys))

    def resume(self, name: str, point: ResumePoint) -> int | None:
        """Continue a replica's streams from another router's resume point: its next frames follow the sequence rules
        from ``point.expected`` (a gap is replayed, a step back is a restart). Only for a replica of the same
        namespace that nothing has fed yet; returns the generation its holdings must be stored under, else None."""
        replica = self._replicas.get(name)
        if replica is None or (replica.model, replica.weight_version) != (point.model, point.weight_version):
            return None
        if replica.streams or replica.first_ts is not None or replica.engine_keys:
            return None
        replica.block_size = point.block_size
        replica.first_ts = point.first_ts
        replica.by_restart = point.by_restart
        replica.streams = {rank: _Stream(expected=seq) for rank, seq in point.expected.items()}
        replica.engine_keys = dict(point.engine_keys)
        return replica.generation

    def engine_started(self, name: str, started_at: float) -> bool:
        """The replica's engine process (re)started at ``started_at`` (epoch seconds, the engine host's clock; its
        scraped ``process_start_time_seconds``): drop what the old process held, unless the current generation
        already began with the new process's own frames, or with this restart seen in the stream before any frame.
        Returns whether the generation was bumped."""
        replica = self._replicas.get(name)
        if replica is None:
            return False
        replica.started_at = started_at
        if replica.first_ts is None and replica.by_restart:
            return False  # the stream showed this restart first, and nothing is held since
        if self._began_with_process(replica, started_at):
            return False
        self._bump(name, replica, clear_streams=True, wiped=True)
        self.stats.restarts += 1
        replica.counts.restarts += 1
        log.warning("kv-events %s: the engine restarted (process start time moved); generation %d", name,
                    replica.generation)
        return True

    def engine_recovered(self, name: str, started_at: float | None) -> bool:
        """The replica passes health checks again after failing them; ``started_at`` is its engine's process start
        time scraped just now (None when unknown). What it held was dropped when it went down, and frames may have
        arrived since. Keep them only if they provably came from the process now running (the generation's first
        frame is later than its start); otherwise forget them. Returns whether the generation was bumped."""
        replica = self._replicas.get(name)
        if replica is None:
            return False
        if started_at is not None:
            replica.started_at = started_at
            if self._began_with_process(replica, started_at):
                return False
        self._bump(name, replica, clear_streams=True)
        self.stats.resets["recovered"] += 1
        return True

    @staticmethod
    def _began_with_process(replica: _Replica, started_at: float) -> bool:
        """The replica's current generation holds only what the process started at ``started_at`` published: it
        began after that start was reported, or with a frame of that process."""
        if replica.began_knowing == started_at:
            return True
        first = replica.first_ts
        return first is not None and (
            first >= started_at + RESTART_CLOCK_MARGIN_S or (replica.by_restart and first >= started_at)
        )

    def _bump(
        self, name: str, replica: _Replica, *, clear_streams: bool, restart: bool = False, wiped: bool = False
    ) -> None:
        """A new generation; ``wiped`` when the engine's cache is known to be empty now (a restart, a reset)."""
        replica.generation += 1
        replica.first_ts = None
        replica.by_restart = restart
        replica.began_knowing = replica.started_at
        self.stats.generations[name] = replica.generation
        self.index.reset_replica(name, replica.generation, wiped=wiped or restart)
        replica.engine_keys.clear()
        if clear_streams:
            replica.streams.clear()

    # frames

    def apply(
        self,
        name: str,
        seq: int,
        payload: bytes | DecodedBatch,
        dp_rank: int | None = None,
        *,
        source: str = "zmq",
        generation: int | None = None,
    ) -> ApplyResult:
        """Apply one frame (msgpack payload or an already decoded batch) under the sequence rules.

        ``source`` is informational ("zmq", "replay", "http"); ``generation``, when given, is the generation the
        caller saw before the frame was fetched: if the replica moved on since, the frame is stale.
        """
        stats = self.stats
        replica = self._replicas.get(name)
        if replica is None:
            stats.dropped["unknown_replica"] += 1
            return ApplyResult(ApplyStatus.UNKNOWN_REPLICA)
        replica.last_frame_at = self.clock()
        counts = replica.counts
        if generation is not None and generation != replica.generation:
            stats.dropped["stale_generation"] += 1
            counts.stale += 1
            return ApplyResult(ApplyStatus.STALE)
        batch: DecodedBatch | None = None
        problem = ""
        try:
            batch = payload if isinstance(payload, DecodedBatch) else decode_batch(payload)
        except MalformedBatch as exc:
            problem = str(exc)
        if batch is not None and replica.started_at is not None and batch.ts < replica.started_at:
            stats.dropped["stale_generation"] += 1  # the old engine's, still in flight after its restart
            counts.stale += 1
            return ApplyResult(ApplyStatus.STALE, generation=replica.generation)
        stream = replica.streams.get(dp_rank)
        if stream is None:
            stream = replica.streams[dp_rank] = _Stream()
        expected = stream.expected
        status = ApplyStatus.APPLIED
        if expected is not None and seq != expected:
            if seq > expected:
                if stream.gap is None:
                    stats.gaps_detected += 1
                    counts.gaps += 1
                    stream.gap = (expected, seq)
                return ApplyResult(ApplyStatus.GAP, expected=expected, got=seq)
            if self._is_duplicate(stream, seq, expected, source):
                stats.dropped["duplicate"] += 1
                counts.duplicates += 1
                return ApplyResult(ApplyStatus.DUPLICATE)
            self._bump(name, replica, clear_streams=True, restart=True)
            stats.restarts += 1
            counts.restarts += 1
            stream = replica.streams[dp_rank] = _Stream()
            status = ApplyStatus.RESTARTED
        stream.expected = seq + 1
        stream.gap = None
        stream.replayed_through = seq if source == "replay" else None
        if batch is None:
            self.malformed(name, f"frame {seq}: {problem}")
            return ApplyResult(ApplyStatus.MALFORMED, generation=replica.generation)
        if replica.first_ts is None:
            replica.first_ts = batch.ts
        applied = self._apply_events(name, replica, batch)
        if replica.first_ts is None:  # an AllBlocksCleared in it started a generation
            replica.first_ts = batch.ts
        stats.frames_applied += 1
        counts.frames_applied += 1
        if source == "replay":
            counts.replayed += 1
        return ApplyResult(status, events=applied, generation=replica.generation)

    def malformed(self, name: str, reason: str) -> None:
        """Count a frame or event no engine would publish, and log it, rate-limited per replica."""
        self.stats.dropped["malformed"] += 1
        replica = self._replicas.get(name)
        if replica is not None:
            replica.counts.malformed += 1
        now = self.clock()
        last, unlogged = self._malformed_logged.get(name, (-math.inf, 0))
        if now - last < MALFORMED_LOG_INTERVAL_S:
            self._malformed_logged[name] = (last, unlogged + 1)
            return
        self._malformed_logged[name] = (now, 0)
        since = f" ({unlogged} more since the last report)" if unlogged else ""
        log.warning("kv-events %s: malformed, ignored: %s%s", name, reason[:_REASON_CHARS], since)

    def _is_duplicate(self, stream: _Stream, seq: int, expected: int, source: str) -> bool:
        if source == "zmq":
            return stream.replayed_through is not None and seq <= stream.replayed_through
        return seq != 0 and expected - seq <= self.duplicate_window

    def _apply_events(self, name: str, replica: _Replica, batch: DecodedBatch) -> int:
        stats = self.stats
        if batch.unknown_events:
            stats.dropped["unknown_type"] += batch.unknown_events
        stats.unknown_fields += batch.unknown_fields
        applied = 0
        events = batch.events
        at, end = 0, len(events)
        while at < end:
            event = events[at]
            at += 1
            if type(event) is Stored:
                applied += self._stored(name, replica, event)
            elif type(event) is Removed:
                # vLLM publishes one BlockRemoved per evicted block: a run of them (same medium) is applied at once
                run = [event]
                while at < end and type(events[at]) is Removed and events[at].medium == event.medium:
                    run.append(events[at])
                    at += 1
                applied += self._removed(name, replica, run)
            elif type(event) is Cleared:
                self._bump(name, replica, clear_streams=False, wiped=True)
                applied += 1
        stats.events_applied += applied
        return applied

    def _stored(self, name: str, replica: _Replica, event: Stored) -> int:
        dropped = self.stats.dropped
        if event.kv_cache_spec_kind not in _FULL_ATTENTION:
            dropped["other_kv_group"] += 1  # sliding-window / mamba groups do not hold a reusable prefix
            return 0
        medium = event.medium
        tier = _GPU_MEDIA.get(medium) if medium in _GPU_MEDIA else tier_of_medium(medium)
        if tier is None:
            dropped["unknown_medium"] += 1
            return 0
        hashes = event.block_hashes
        block_size = event.block_size
        if len(event.token_ids) != len(hashes) * block_size:
            self.malformed(name, f"BlockStored with {len(hashes)} hashes and {len(event.token_ids)} token ids")
            return 0
        extra_keys = event.extra_keys
        if event.parent is None:
            salt, extras = _split_salt(event, extra_keys)
            parent = self._namespace(replica, salt, event.lora_name)
        else:
            found = replica.engine_keys.get(event.parent)
            if found is None:
                dropped["orphan"] += 1
                replica.counts.orphans += 1
                return 0
            parent = found
            extras = _fold_extras(extra_keys, event.lora_name) if extra_keys else None
        try:
            keys = block_keys(parent, event.token_ids, block_size, extras)
        except (OverflowError, TypeError, ValueError) as exc:
            self.malformed(name, f"BlockStored whose token ids or extra keys do not encode: {exc}")
            return 0
        self.index.store(name, keys, tier, replica.generation)
        replica.engine_keys.update(zip(hashes, keys))
        replica.block_size = block_size
        return 1

    def _removed(self, name: str, replica: _Replica, run: list[Removed]) -> int:
        """Consecutive ``BlockRemoved`` events of one medium; how many were applied."""
        tier = tier_of_medium(run[0].medium)
        if tier is None:
            self.stats.dropped["unknown_medium"] += len(run)
            return 0
        engine_keys = replica.engine_keys
        hashes: dict[int, int] = {}
        """Each removed engine hash kvgate knows, and its key."""
        for event in run:
            for engine_hash in event.block_hashes:
                key = engine_keys.get(engine_hash)
                if key is None:
                    self.stats.unknown_removed += 1
                else:
                    hashes[engine_hash] = key
        if tier is Tier.GPU:
            self.index.evicted(name)
        if hashes:
            gone = self.index.remove(name, list(hashes.values()), tier)
            if gone:
                for engine_hash, key in hashes.items():
                    if key in gone:
                        del engine_keys[engine_hash]
        return len(run)

    def _namespace(self, replica: _Replica, salt: str | None, lora_name: str | None) -> int:
        ns = replica.namespaces.get((salt, lora_name))
        if ns is None:
            ns = namespace_key(replica.model, replica.weight_version, salt, lora_name)
            replica.namespaces[(salt, lora_name)] = ns
        return ns


def _split_salt(event: Stored, extra_keys: list[Any] | None) -> tuple[str | None, list[Any] | None]:
    """Take the cache salt out of a chain head's extra keys; the other extra keys stay with their blocks."""
    salt = event.cache_salt
    if not extra_keys:
        return salt, None
    head = _block_extras(extra_keys[0], event.lora_name)
    if head is not None:
        if salt is None:
            salt = next((item for item in head if isinstance(item, str)), None)
        head = [item for item in head if item != salt] or None
    folded = [head, *(_block_extras(extra, event.lora_name) for extra in extra_keys[1:])]
    return salt, folded if any(extra is not None for extra in folded) else None


def _fold_extras(extra_keys: list[Any], lora_name: str | None) -> list[Any] | None:
    """Per-block extra keys without the LoRA entry (the namespace has it), or None when no block has any."""
    folded = [_block_extras(extra, lora_name) for extra in extra_keys]
    return folded if any(extra is not None for extra in folded) else None


def _block_extras(extra: Any, lora_name: str | None) -> list[Any] | None:
    """One block's extra keys as a list, without its LoRA entry: the bare name (vLLM ≤0.29) or an entry naming it
    (0.33 publishes the adapter with its path)."""
    if extra is None:
        return None
    items = extra if isinstance(extra, list) else [extra]
    if lora_name is not None:
        items = [item for item in items if item != lora_name and not (isinstance(item, list) and lora_name in item)]
    return items or None
