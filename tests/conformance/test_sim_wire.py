"""The sim's own declaration of vLLM 0.33's event classes (``loadgen/sim/wire.py``) reproduces the frames made with
vLLM's own code byte for byte, both ways: decoding a vector and encoding it again, and encoding the vector's decoded
(JSON) form built into the sim's classes. No kvgate module is imported here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvgate.loadgen.sim.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_seq

VECTOR = "vllm-kv-events.json"


def vector_frames(vectors_dir: Path) -> list[dict[str, Any]]:
    return json.loads((vectors_dir / VECTOR).read_text())["frames"]


def test_the_vector_file_has_frames(vectors_dir: Path) -> None:
    assert len(vector_frames(vectors_dir)) == 4


@pytest.mark.parametrize("index", range(4))
def test_decoding_then_encoding_gives_the_same_bytes(vectors_dir: Path, index: int) -> None:
    payload = bytes.fromhex(vector_frames(vectors_dir)[index]["payload_hex"])
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert msgspec.msgpack.encode(batch) == payload


@pytest.mark.parametrize("index", range(4))
def test_the_decoded_form_encodes_to_the_vector_bytes(vectors_dir: Path, index: int) -> None:
    frame = vector_frames(vectors_dir)[index]
    batch = msgspec.json.decode(json.dumps(frame["decoded"]), type=KVEventBatch)
    assert msgspec.msgpack.Encoder().encode(batch) == bytes.fromhex(frame["payload_hex"])
    assert encode_seq(int(frame["seq_hex"], 16)) == bytes.fromhex(frame["seq_hex"])


def test_events_built_as_the_sim_builds_them(vectors_dir: Path) -> None:
    """The sim's BlockPool constructs events with keywords; these are the vector's third frame."""
    frame = vector_frames(vectors_dir)[2]
    tokens = list(range(1016, 1032))
    batch = KVEventBatch(
        ts=1764400001.0,
        events=[
            BlockRemoved(block_hashes=[17027874615116373601], medium="GPU"),
            BlockStored(block_hashes=[17027874615116373601], parent_block_hash=7322446309363477352,
                        token_ids=tokens, block_size=16, lora_id=None, medium="CPU", lora_name=None),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.encode(batch) == bytes.fromhex(frame["payload_hex"])
    assert frame["topic_hex"] == b"kv-events".hex()


def test_end_marker_is_minus_one() -> None:
    assert END_SEQ == b"\xff" * 8
