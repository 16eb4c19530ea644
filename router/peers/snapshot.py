"""The index snapshot one gateway replica hands another: its wire format, and taking and applying it.

A snapshot lists, per engine replica, who the engine is (its KV-event endpoint and its process start time as the
giving gateway scraped it), the replica's index state (:mod:`cache_index.snapshot`) and, per DP-rank stream, the last
frame applied (sequence number and bytes), so a gap after it is replayed from that very frame and the replay proves
it comes from the same engine. It is msgpack (msgspec), typed and strict: unknown fields are errors.

The receiver trusts nothing in it. A snapshot that does not decode, fails a consistency check, or whose replicas are
other engines (another KV-event endpoint) or serve another model than this gateway's replicas of the same name is
rejected whole. A replica whose engine restarted since (another process start time), or that this gateway does not
see healthy, is left out; a restart the start time cannot show (no start time, or the restarted engine's sequence
numbers) the event stream shows: a step back is a restart, and a gap is replayed from the last frame, whose bytes a
restarted engine cannot reproduce.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.snapshot import (
    MAX_DP_RANK,
    MAX_SEQ,
    InvalidState,
    ReplicaState,
    check_state,
    export_states,
    import_state,
)
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
CONTENT_TYPE = "application/vnd.kvgate.snapshot+msgpack"


class StreamAnchor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dp_rank: int | None
    seq: int
    payload: bytes
    """The frame's bytes as the engine published them."""


class ReplicaEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    kv_events: str | None
    engine_started_at: float | None
    """The engine's process start time the giving gateway last scraped (None: not exported)."""
    state: ReplicaState
    anchors: list[StreamAnchor]


class Snapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    replicas: list[ReplicaEntry]


class SnapshotRejected(Exception):
    """Nothing of the snapshot may be used."""


_encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(Snapshot)


def take_snapshot(fleet: Fleet, ingestor: EventIngestor, subscriptions: SubscriptionManager) -> bytes:
    """This gateway's view of every tracked replica, encoded."""
    anchors: dict[str, list[StreamAnchor]] = {}
    for subscriber in subscriptions.subscribers():
        last = subscriber.last_applied
        if last is not None and ingestor.expected_seq(subscriber.name, subscriber.dp_rank) == last[0] + 1:
            anchors.setdefault(subscriber.name, []).append(StreamAnchor(subscriber.dp_rank, *last))
    entries = []
    for name, state in export_states(ingestor).items():
        replica = fleet.replicas.get(name)
        if replica is None:
            continue
        entries.append(ReplicaEntry(name, replica.config.kv_events, replica.engine_started_at, state,
                                    anchors.get(name, [])))
    return _encode(Snapshot(SNAPSHOT_FORMAT, entries))


def decode_snapshot(raw: bytes) -> Snapshot:
    """Decode and check a snapshot received from a peer; :class:`SnapshotRejected` when any part is wrong."""
    try:
        snapshot = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotRejected(f"does not decode: {e}") from e
    if snapshot.format != SNAPSHOT_FORMAT:
        raise SnapshotRejected(f"format {snapshot.format}, expected {SNAPSHOT_FORMAT}")
    names = [entry.name for entry in snapshot.replicas]
    if len(set(names)) != len(names):
        raise SnapshotRejected("a replica appears twice")
    for entry in snapshot.replicas:
        try:
            check_state(entry.state)
        except InvalidState as e:
            raise SnapshotRejected(f"replica {entry.name[:100]!r}: {e}") from e
        for anchor in entry.anchors:
            if not 0 <= anchor.seq < MAX_SEQ or (anchor.dp_rank is not None and not 0 <= anchor.dp_rank < MAX_DP_RANK):
                raise SnapshotRejected(f"replica {entry.name[:100]!r}: an anchor out of range")
    return snapshot


@dataclass(slots=True)
class Applied:
    imported: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    """Replica → why its part was not imported."""
    anchors: dict[tuple[str, int | None], tuple[int, bytes]] = field(default_factory=dict)
    """(replica, DP rank) → the last frame applied before the snapshot, for the subscriptions about to start."""


def apply_snapshot(
    snapshot: Snapshot, fleet: Fleet, ingestor: EventIngestor, namespace_of: Callable[[Replica], tuple[str, str]]
) -> Applied:
    """Import a decoded snapshot's replicas into a gateway whose subscriptions have not started yet.

    ``namespace_of`` gives a replica's (model, weight version) in this gateway. Raises :class:`SnapshotRejected`,
    importing nothing, when a replica of the same name is another engine or serves another model here."""
    present = [(entry, fleet.replicas[entry.name]) for entry in snapshot.replicas if entry.name in fleet.replicas]
    for entry, replica in present:
        if entry.kv_events != replica.config.kv_events:
            raise SnapshotRejected(f"replica {entry.name!r} is another engine there ({entry.kv_events!r})")
        if (entry.state.model, entry.state.weight_version) != namespace_of(replica):
            raise SnapshotRejected(f"replica {entry.name!r} serves another model there ({entry.state.model!r})")
    applied = Applied()
    for entry in snapshot.replicas:
        if entry.name not in fleet.replicas:
            applied.left_out[entry.name] = "not in this fleet"
    for entry, replica in present:
        reason = _left_out(entry, replica)
        if reason is None and not import_state(ingestor, entry.name, entry.state):
            reason = "already fed by its own events"
        if reason is not None:
            applied.left_out[entry.name] = reason
            continue
        applied.imported.append(entry.name)
        expected = {stream.dp_rank: stream.expected for stream in entry.state.streams}
        for anchor in entry.anchors:
            if expected.get(anchor.dp_rank) == anchor.seq + 1:
                applied.anchors[(entry.name, anchor.dp_rank)] = (anchor.seq, anchor.payload)
    return applied


def _left_out(entry: ReplicaEntry, replica: Replica) -> str | None:
    if replica.health.up is not True:
        return "not healthy here"
    if entry.engine_started_at != replica.engine_started_at:
        return "its engine restarted since (process start time)"
    return None
