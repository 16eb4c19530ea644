"""One replica's prefix-index state as another router can take it over: pure export, check and import (no transport).

A router that starts while others run takes this state from one of them instead of starting cold, and then
continues the engine's event stream from where the other router stood. Per replica it holds what the event
stream would have taught it: the holdings with their tiers, the engine-hash → key map (``BlockRemoved`` and child
``BlockStored`` events resolve through it), the block size, and per DP-rank stream the next sequence number expected.

Keys, tiers and hashes travel packed (little-endian uint64 arrays, one tier byte per key), so a state of millions of
holdings encodes and decodes in one copy. Whatever arrives is hostile: :func:`check_state` rejects anything no router
exports, before anything is imported.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence

import msgspec

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import EventIngestor, ResumePoint
from kvgate.cache_index.match import Tier

MAX_SEQ = (1 << 64) - 1
"""Sequence numbers travel as 8-byte frames."""
MAX_DP_RANK = 4096
MAX_BLOCK_SIZE = 1 << 16
_UINT64 = 8
_TIER_BITS = (1 << len(Tier)) - 1


class StreamPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dp_rank: int | None
    expected: int
    """The next sequence number this DP rank's stream expects."""


class ReplicaState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    weight_version: str
    block_size: int | None
    first_ts: float | None
    """Timestamp of the first batch of the replica's current generation (tells a later restart's frames apart)."""
    by_restart: bool
    streams: list[StreamPoint]
    keys: bytes
    """Held keys, packed uint64, least recently used first."""
    tiers: bytes
    """One byte per key: bit ``t`` set when held in tier ``t``."""
    engine_hashes: bytes
    """Packed uint64 engine block hashes, and at the same positions in ``engine_keys`` their kvgate keys."""
    engine_keys: bytes


class InvalidState(ValueError):
    """A replica state no router exports."""


def pack_keys(values: Sequence[int]) -> bytes:
    """Keys (or engine hashes) as packed little-endian uint64s."""
    packed = values if isinstance(values, array) else array("Q", values)
    if sys.byteorder != "little":
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(raw: bytes) -> array[int]:
    """The inverse of :func:`pack_keys` (``raw``'s length a multiple of 8)."""
    values = array("Q")
    values.frombytes(raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def export_states(ingestor: EventIngestor) -> dict[str, ReplicaState]:
    """Every tracked replica's state, as :func:`import_state` takes it."""
    points = {name: point for name in ingestor.replicas() if (point := ingestor.resume_point(name)) is not None}
    holdings = ingestor.index.export_holdings(list(points))
    states: dict[str, ReplicaState] = {}
    for name, point in points.items():
        keys, tiers = holdings.get(name, (array("Q"), bytearray()))
        states[name] = ReplicaState(
            model=point.model,
            weight_version=point.weight_version,
            block_size=point.block_size,
            first_ts=point.first_ts,
            by_restart=point.by_restart,
            streams=[StreamPoint(rank, seq) for rank, seq in point.expected.items()],
            keys=pack_keys(keys),
            tiers=bytes(tiers),
            engine_hashes=pack_keys(list(point.engine_keys)),
            engine_keys=pack_keys(list(point.engine_keys.values())),
        )
    return states


def check_state(state: ReplicaState) -> None:
    """Raise :class:`InvalidState` unless ``state`` is consistent: packed arrays of whole uint64s and matching
    lengths, tier bytes naming known tiers, engine keys that are held keys, sane block size, ranks and sequence
    numbers."""
    if len(state.keys) % _UINT64 or len(state.keys) // _UINT64 != len(state.tiers):
        raise InvalidState("keys and tiers do not match")
    if len(state.engine_hashes) % _UINT64 or len(state.engine_hashes) != len(state.engine_keys):
        raise InvalidState("engine hashes and keys do not match")
    if state.tiers and (0 in state.tiers or max(state.tiers) > _TIER_BITS):
        raise InvalidState("a tier byte names no tier")
    if state.block_size is not None and not 0 < state.block_size <= MAX_BLOCK_SIZE:
        raise InvalidState(f"block size {state.block_size}")
    if state.first_ts is not None and not math.isfinite(state.first_ts):
        raise InvalidState("first_ts is not finite")
    ranks = [stream.dp_rank for stream in state.streams]
    if len(set(ranks)) != len(ranks):
        raise InvalidState("a DP rank appears twice")
    for stream in state.streams:
        if stream.dp_rank is not None and not 0 <= stream.dp_rank < MAX_DP_RANK:
            raise InvalidState(f"DP rank {stream.dp_rank}")
        if not 0 <= stream.expected <= MAX_SEQ:
            raise InvalidState(f"sequence number {stream.expected}")
    keys = unpack_keys(state.keys)
    if len(set(keys)) != len(keys):
        raise InvalidState("a key appears twice")
    if not set(unpack_keys(state.engine_keys)) <= set(keys):
        raise InvalidState("an engine hash maps to a key not held")


def import_state(ingestor: EventIngestor, name: str, state: ReplicaState) -> bool:
    """Take over a checked state for a tracked replica that nothing has fed yet, in the same namespace (model and
    weight version); False, importing nothing, otherwise."""
    point = ResumePoint(
        model=state.model,
        weight_version=state.weight_version,
        block_size=state.block_size,
        first_ts=state.first_ts,
        by_restart=state.by_restart,
        expected={stream.dp_rank: stream.expected for stream in state.streams},
        engine_keys=dict(zip(unpack_keys(state.engine_hashes), unpack_keys(state.engine_keys))),
    )
    generation = ingestor.resume(name, point)
    if generation is None:
        return False
    _store(ingestor.index, name, unpack_keys(state.keys), state.tiers, generation)
    return True


def _store(index: PrefixIndex, name: str, keys: array[int], tiers: bytes, generation: int) -> None:
    for tier in Tier:
        bit = 1 << tier
        held = [key for key, bits in zip(keys, tiers) if bits & bit]
        if held:
            held.reverse()  # store() makes its first key the most recent: keep the exporter's order
            index.store(name, held, tier, generation)
