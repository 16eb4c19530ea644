"""vLLM 0.33's KV-event classes and ZMQ framing constants, as the simulated engine publishes them.

Declared exactly as ``vllm/distributed/kv_events.py`` declares them and encoded with ``msgspec.msgpack.Encoder`` as
its ``ZmqEventPublisher`` does: the batch is a positional array ``[ts, events, data_parallel_rank]`` and each event a
map tagged with ``"type"`` (fields with a default are left out when unset). The sim keeps its own copy rather than
kvgate's decoder classes, so a mistake in kvgate's reading of the wire cannot be mirrored here; the conformance tests
check these classes byte for byte against frames made with vLLM's own code (``tests/vectors/``).
"""

from __future__ import annotations

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of every event; ``tag=True`` writes ``{"type": "<ClassName>", ...}``."""


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


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's sequence frame."""


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame of a published batch."""
    return seq.to_bytes(8, "big")
