"""vLLM 0.33's KV-event classes, declared exactly as vLLM declares them.

These are the shapes `vllm/distributed/kv_events.py` encodes with `msgspec.msgpack.Encoder` and publishes on ZMQ:
the batch is a positional array ``[ts, events, data_parallel_rank]`` and, from vLLM 0.24 on, each event is a map
tagged with ``"type"``. The simulated fleet publishes with these classes so that what it sends is byte for byte what a
real engine sends; the decoder in :mod:`cache_index.events` accepts these and every older or foreign encoding.
"""

from __future__ import annotations

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of every event; ``tag=True`` makes msgspec write ``{"type": "<ClassName>", ...}``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's sequence frame."""


def encode_seq(seq: int) -> bytes:
    """8-byte big-endian sequence number, as the publisher frames it."""
    return seq.to_bytes(8, "big")
