"""Every frame of the engines' own conformance vectors decodes, and applying them yields the expected holdings."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvgate.cache_index.events import Cleared, MalformedBatch, Removed, Stored, decode_batch, decode_batch_object
from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import ApplyStatus, EventIngestor
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch

MODEL = "m"
TOKENS = list(range(1000, 1032))
VECTOR_FILES = ["vllm-kv-events.json", "vllm-0.23-kv-events.json", "sglang-kv-events.json"]


def frames(vectors_dir: Path, name: str) -> list[tuple[int, bytes, object]]:
    data = json.loads((vectors_dir / name).read_text())
    return [(int(f["seq_hex"], 16), bytes.fromhex(f["payload_hex"]), f["decoded"]) for f in data["frames"]]


def lookup(index: PrefixIndex, salt: str | None = None, tokens: list[int] = TOKENS) -> dict[str, PrefixMatch]:
    return index.lookup(block_keys(namespace_key(MODEL, cache_salt=salt), tokens, 16), 16)


def fresh() -> tuple[PrefixIndex, EventIngestor]:
    index = PrefixIndex()
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model=MODEL)
    return index, ingestor


def without_last_event(payload: bytes) -> bytes:
    """The same batch minus its final event (to look at the index just before an AllBlocksCleared)."""
    raw = msgspec.msgpack.decode(payload)
    raw[1] = raw[1][:-1]
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("name", VECTOR_FILES)
def test_every_frame_decodes_as_msgpack_and_as_its_json_form(vectors_dir: Path, name: str) -> None:
    for _, payload, decoded in frames(vectors_dir, name):
        batch = decode_batch(payload)
        assert batch.events
        assert batch.unknown_events == 0 and batch.unknown_fields == 0
        assert decode_batch_object(decoded) == batch


def test_vllm_033_frames(vectors_dir: Path) -> None:
    index, ingestor = fresh()
    (s0, f0, _), (s1, f1, _), (s2, f2, _), (s3, f3, _) = frames(vectors_dir, "vllm-kv-events.json")

    assert ingestor.apply("r", s0, f0).status is ApplyStatus.APPLIED
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    assert lookup(index, tokens=TOKENS[:16] + [7] * 16) == {"r": PrefixMatch(gpu=16)}
    assert lookup(index, salt="tenant-a") == {}

    assert ingestor.apply("r", s1, f1).applied
    assert lookup(index, salt="tenant-a") == {"r": PrefixMatch(gpu=32)}
    assert lookup(index, salt="tenant-b") == {}

    # frame 2: block 1 leaves the GPU and is stored again on CPU, then everything is cleared
    before_clear = without_last_event(f2)
    index_b, ingestor_b = fresh()
    ingestor_b.apply("r", s0, f0)
    ingestor_b.apply("r", s1, before_clear)
    assert lookup(index_b) == {"r": PrefixMatch(gpu=16, cpu=16)}
    generation = ingestor.generation("r")
    assert ingestor.apply("r", s2, f2).applied
    assert lookup(index) == {} and lookup(index, salt="tenant-a") == {}
    assert ingestor.generation("r") == generation + 1

    # frame 3: raw 32-byte hashes name the same blocks as the uint64 form
    assert ingestor.apply("r", s3, f3).applied
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    uint64_hashes = decode_batch(f0).events[0].block_hashes
    assert decode_batch(f3).events[0].block_hashes == uint64_hashes


def test_vllm_023_tagged_arrays(vectors_dir: Path) -> None:
    index, ingestor = fresh()
    (s0, f0, _), (s1, f1, _) = frames(vectors_dir, "vllm-0.23-kv-events.json")
    ingestor.apply("r", s0, f0)
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    removed, cleared = decode_batch(f1).events
    assert isinstance(removed, Removed) and isinstance(cleared, Cleared)
    index_b, ingestor_b = fresh()
    ingestor_b.apply("r", s0, f0)
    ingestor_b.apply("r", s1, without_last_event(f1))
    assert lookup(index_b) == {"r": PrefixMatch(gpu=16)}
    ingestor.apply("r", s1, f1)
    assert lookup(index) == {}


def test_sglang_frames(vectors_dir: Path) -> None:
    index, ingestor = fresh()
    (s0, f0, _), (s1, f1, _), (s2, f2, _) = frames(vectors_dir, "sglang-kv-events.json")
    stored = decode_batch(f0).events[0]
    assert isinstance(stored, Stored) and stored.block_hashes == [-3512263940372185041 % 2**64]

    ingestor.apply("r", s0, f0)
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    ingestor.apply("r", s1, f1)
    assert lookup(index, salt="tenant-a") == {"r": PrefixMatch(gpu=16)}
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}

    index_b, ingestor_b = fresh()
    ingestor_b.apply("r", s0, f0)
    ingestor_b.apply("r", s1, without_last_event(f2))
    assert lookup(index_b) == {"r": PrefixMatch(cpu=16)}
    ingestor.apply("r", s2, f2)
    assert lookup(index) == {} and lookup(index, salt="tenant-a") == {}


def encode(batch: list) -> bytes:
    return msgspec.msgpack.encode(batch)


def stored_map(hashes: list, parent: object, tokens: list[int], **extra: object) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 16, "lora_id": None, "medium": "GPU", **extra}


def test_int64_hashes_two_element_batches_and_mixed_hash_forms() -> None:
    index, ingestor = fresh()
    signed = -(2**62)
    ingestor.apply("r", 0, encode([1.0, [stored_map([signed], None, TOKENS[:16])]]))  # 0.9.0: [ts, events]
    as_bytes = (signed % 2**64).to_bytes(8, "big")
    ingestor.apply("r", 1, encode([1.0, [stored_map([123], as_bytes, TOKENS[16:])], 0]))
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    ingestor.apply("r", 2, encode([1.0, [{"type": "BlockRemoved", "block_hashes": [signed % 2**64], "medium": "GPU"}]]))
    assert lookup(index) == {}


def test_oldest_array_events_have_fewer_fields_and_newer_ones_more() -> None:
    index, ingestor = fresh()
    v090 = ["BlockStored", [1, 2], None, TOKENS, 16, None]  # no medium at all: GPU
    ingestor.apply("r", 0, encode([1.0, [v090]]))
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}
    future = ["BlockRemoved", [2], "GPU", 0, "LOCAL", "owner", "something-new"]
    batch = decode_batch(encode([1.0, [future], 0]))
    assert batch.unknown_fields == 1 and batch.events == [Removed(block_hashes=[2], medium="GPU")]
    ingestor.apply("r", 1, encode([1.0, [future], 0]))
    assert lookup(index) == {"r": PrefixMatch(gpu=16)}


def test_unknown_event_types_and_fields_are_ignored_and_counted() -> None:
    index, ingestor = fresh()
    events = [
        {"type": "BlockPinned", "block_hashes": [1]},
        ["SomethingElse", 1, 2],
        stored_map([1, 2], None, TOKENS, novel_field={"x": 1}),
    ]
    result = ingestor.apply("r", 0, encode([1.0, events, 0]))
    assert result.applied and result.events == 1
    assert ingestor.stats.dropped["unknown_type"] == 2
    assert ingestor.stats.unknown_fields == 1
    assert lookup(index) == {"r": PrefixMatch(gpu=32)}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1garbage",
        encode({"ts": 1.0}),
        encode([1.0]),
        encode(["x", []]),
        encode([1.0, [42]]),
        encode([1.0, [stored_map("nope", None, TOKENS)]]),
        encode([1.0, [{"type": "BlockStored"}]]),
        encode([1.0, [stored_map([1.5], None, TOKENS[:16])]]),
        encode([1.0, [stored_map([1], None, TOKENS[:16], medium=7)]]),
    ],
)
def test_garbage_payloads_raise_one_exception_type_and_are_counted(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)
    _, ingestor = fresh()
    assert ingestor.apply("r", 0, payload).status is ApplyStatus.MALFORMED
    assert ingestor.stats.dropped["malformed"] == 1
    assert ingestor.apply("r", 1, encode([1.0, [], 0])).applied  # the stream carries on


def test_a_malformed_frame_in_sequence_keeps_the_replicas_holdings() -> None:
    index, ingestor = fresh()
    ingestor.apply("r", 0, encode([1.0, [stored_map([1, 2], None, TOKENS)], 0]))
    held = lookup(index)
    assert held
    assert ingestor.apply("r", 1, b"\xc1").status is ApplyStatus.MALFORMED
    assert lookup(index) == held and ingestor.stats.purges == 0
    assert ingestor.apply("r", 2, encode([1.0, [], 0])).status is ApplyStatus.APPLIED  # its number was taken: no gap
