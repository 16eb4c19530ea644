"""Decode every KV-event encoding real engines publish into one normalised form.

Accepted shapes (engine-protocols.md §1.4–1.6, §3):

- batch ``[ts, events]`` (vLLM 0.9.0) or ``[ts, events, dp_rank]`` (vLLM ≥0.9.1, SGLang's ``attn_dp_rank``);
- events as tagged arrays ``["BlockStored", field, ...]`` (vLLM ≤0.23, SGLang ≤0.5.10), read by position with
  missing trailing fields defaulted and extra trailing fields ignored, or as tagged maps ``{"type": ...}``
  (vLLM ≥0.24, SGLang ≥0.5.20), read by name with unknown fields ignored;
- block hashes as uint64, signed int64 (SGLang) or raw bytes (vLLM with int hashes off; base64 text in JSON).

Every engine hash is reduced to one canonical form, an unsigned 64-bit int: ints are taken modulo 2**64 (so a
signed int64 and its uint64 twin agree) and bytes contribute their last 8 bytes big-endian (what vLLM publishes as
its int hash). Stored and removed events go through the same function, so they always match.

Unknown event types and unknown fields are counted in the batch and otherwise ignored; anything that does not have
the shape of a batch raises :class:`MalformedBatch`, the one exception a caller has to count.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec

_HASH_MASK = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


class MalformedBatch(ValueError):
    """The payload is not a KV-event batch any known engine publishes."""


class Stored(msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True, gc=False):
    """Blocks an engine now holds: ``block_hashes[i]`` covers ``token_ids[i*block_size:(i+1)*block_size]``.

    Also the typed-decoding target of vLLM ≥0.24 / SGLang map events (hence the wire names and the fields kvgate
    reads but does not use: declaring them keeps them from counting as unknown).
    """

    block_hashes: list[int]
    parent: int | None = msgspec.field(name="parent_block_hash")
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    cache_salt: str | None = None
    kv_cache_spec_kind: str | None = None
    lora_id: int | None = None
    group_idx: int | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True, gc=False):
    """Blocks an engine evicted from one medium."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True, gc=False):
    """The engine dropped its whole prefix cache."""


Event = Stored | Removed | Cleared


class DecodedBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    unknown_events: int = 0
    """Events of a type this decoder does not know (ignored)."""
    unknown_fields: int = 0
    """Events that carried fields this decoder does not know (the fields were ignored)."""


_STORED_POSITIONS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_POSITIONS = ("block_hashes", "medium", "group_idx")
_STORED_FIELDS = frozenset(
    {"type", *_STORED_POSITIONS, "locality", "ownership", "session_id", "lookahead_token_ids", "cache_salt"}
)
_REMOVED_FIELDS = frozenset({"type", *_REMOVED_POSITIONS, "locality", "ownership"})
_CLEARED_FIELDS = frozenset({"type"})


def canonical_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit int (see the module docstring)."""
    if type(value) is int:
        if _INT64_MIN <= value <= _HASH_MASK:  # type: ignore[operator]
            return value & _HASH_MASK  # type: ignore[operator]
        raise MalformedBatch(f"block hash out of 64-bit range: {value}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise MalformedBatch("empty block hash")
        return int.from_bytes(raw[-8:], "big")
    if isinstance(value, str):  # JSON carries raw hashes as base64 text
        try:
            return canonical_hash(base64.b64decode(value, validate=True))
        except binascii.Error as exc:
            raise MalformedBatch(f"block hash is neither an int nor base64 bytes: {value!r}") from exc
    raise MalformedBatch(f"block hash of type {type(value).__name__}")


def _hashes(value: object) -> list[int]:
    if not isinstance(value, list):
        raise MalformedBatch("block_hashes is not a list")
    if all(type(h) is int and 0 <= h <= _HASH_MASK for h in value):
        return value
    return [canonical_hash(h) for h in value]


def _optional_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedBatch(f"{name} is not a string")


def _stored(fields: dict[str, Any]) -> Stored:
    token_ids = fields.get("token_ids")
    block_size = fields.get("block_size")
    if not isinstance(token_ids, list) or type(block_size) is not int or block_size <= 0:
        raise MalformedBatch("BlockStored without token_ids or a positive block_size")
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    extra_keys = fields.get("extra_keys")
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise MalformedBatch("extra_keys is not a list")
    return Stored(
        block_hashes=hashes,
        parent=None if parent is None else canonical_hash(parent),
        token_ids=token_ids,
        block_size=block_size,
        medium=_optional_str(fields.get("medium"), "medium"),
        lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
        extra_keys=extra_keys,
        cache_salt=_optional_str(fields.get("cache_salt"), "cache_salt"),
        kv_cache_spec_kind=_optional_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
    )


def _removed(fields: dict[str, Any]) -> Removed:
    return Removed(
        block_hashes=_hashes(fields.get("block_hashes")),
        medium=_optional_str(fields.get("medium"), "medium"),
    )


_BUILDERS = {
    "BlockStored": (_stored, _STORED_POSITIONS, _STORED_FIELDS),
    "BlockRemoved": (_removed, _REMOVED_POSITIONS, _REMOVED_FIELDS),
    "AllBlocksCleared": (lambda fields: Cleared(), (), _CLEARED_FIELDS),
}


def _normalise(raw: object) -> DecodedBatch:
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedBatch("batch is not an array [ts, events, dp_rank?]")
    ts, raw_events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    if type(ts) not in (int, float) or not isinstance(raw_events, list):
        raise MalformedBatch("batch ts is not a number or events is not an array")
    if dp_rank is not None and type(dp_rank) is not int:
        raise MalformedBatch("batch dp_rank is not an int")
    batch = DecodedBatch(ts=float(ts), events=[], dp_rank=dp_rank)
    events = batch.events
    for raw_event in raw_events:
        if isinstance(raw_event, dict):
            tag = raw_event.get("type")
            builder = _BUILDERS.get(tag)  # type: ignore[arg-type]
            if builder is None:
                batch.unknown_events += 1
                continue
            build, _, known = builder
            if not raw_event.keys() <= known:
                batch.unknown_fields += 1
            events.append(build(raw_event))
        elif isinstance(raw_event, list) and raw_event and isinstance(raw_event[0], str):
            builder = _BUILDERS.get(raw_event[0])
            if builder is None:
                batch.unknown_events += 1
                continue
            build, positions, _ = builder
            if len(raw_event) - 1 > len(positions):
                batch.unknown_fields += 1
            events.append(build(dict(zip(positions, raw_event[1:]))))
        else:
            raise MalformedBatch("event is neither a tagged map nor a tagged array")
    return batch


class _MapEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The common modern shape (map events, int hashes, only known fields), decoded in C without a generic pass."""

    ts: float
    events: list[Stored | Removed | Cleared]
    dp_rank: int | None = None


_typed_decode = msgspec.msgpack.Decoder(_MapEventBatch).decode
_msgpack_decode = msgspec.msgpack.Decoder().decode


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack ``KVEventBatch`` payload as published on ZMQ."""
    try:
        typed = _typed_decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        pass  # array events, bytes hashes, unknown types or fields, or garbage: the generic path sorts it out
    else:
        for event in typed.events:
            if type(event) is not Cleared:
                hashes = event.block_hashes
                if hashes and min(hashes) < 0:  # SGLang's signed int64 → the canonical uint64
                    event.block_hashes = [h & _HASH_MASK for h in hashes]
                if type(event) is Stored and event.parent is not None and event.parent < 0:
                    event.parent &= _HASH_MASK
        return DecodedBatch(ts=typed.ts, events=typed.events, dp_rank=typed.dp_rank)  # type: ignore[arg-type]
    try:
        raw = _msgpack_decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedBatch(f"not msgpack: {exc}") from exc
    return _normalise(raw)


def decode_batch_object(raw: object) -> DecodedBatch:
    """Normalise a batch already parsed from JSON (``[ts, events, dp_rank]``, hashes as ints or base64 text)."""
    return _normalise(raw)
