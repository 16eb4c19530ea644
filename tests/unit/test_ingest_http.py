"""HTTP ingestion: msgpack body with headers, or JSON body; same sequence rules as ZMQ."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvgate.cache_index.http_ingest import HttpIngestError, ingest_http
from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import ApplyStatus, EventIngestor
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch

TOKENS = list(range(1000, 1032))


@pytest.fixture
def setup() -> tuple[PrefixIndex, EventIngestor]:
    index = PrefixIndex()
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    return index, ingestor


def vllm_frames(vectors_dir: Path) -> list[dict]:
    return json.loads((vectors_dir / "vllm-kv-events.json").read_text())["frames"]


def test_msgpack_body_with_headers(setup, vectors_dir: Path) -> None:
    index, ingestor = setup
    body = bytes.fromhex(vllm_frames(vectors_dir)[0]["payload_hex"])
    result = ingest_http(ingestor, "r", body, "application/msgpack", seq=1)
    assert result.status is ApplyStatus.APPLIED
    assert ingest_http(ingestor, "r", body, "application/msgpack", seq=1).status is ApplyStatus.DUPLICATE  # retry
    assert index.lookup(block_keys(namespace_key("m"), TOKENS, 16), 16) == {"r": PrefixMatch(gpu=32)}


def test_json_body_with_base64_bytes_hashes(setup, vectors_dir: Path) -> None:
    index, ingestor = setup
    last = vllm_frames(vectors_dir)[3]  # raw 32-byte hashes, written as base64 in JSON
    body = msgspec.json.encode({"replica": "r", "seq": 3, "batch": last["decoded"]})
    assert ingest_http(ingestor, None, body, "application/json; charset=utf-8").applied
    assert index.lookup(block_keys(namespace_key("m"), TOKENS, 16), 16) == {"r": PrefixMatch(gpu=32)}


def test_a_gap_over_http_purges_and_starts_over_at_the_posted_frame(setup, vectors_dir: Path) -> None:
    index, ingestor = setup
    first = bytes.fromhex(vllm_frames(vectors_dir)[0]["payload_hex"])
    ingest_http(ingestor, "r", first, "application/msgpack", seq=0)
    later = msgspec.json.encode({"seq": 9, "batch": [1.0, []]})
    assert ingest_http(ingestor, "r", later, "application/json").status is ApplyStatus.APPLIED
    assert ingestor.stats.gaps_detected == 1 and ingestor.stats.purges == 1
    assert index.lookup(block_keys(namespace_key("m"), TOKENS, 16), 16) == {}
    assert ingestor.expected_seq("r") == 10


def test_malformed_json_batch_is_counted_in_sequence(setup) -> None:
    _, ingestor = setup
    body = msgspec.json.encode({"replica": "r", "seq": 0, "batch": {"not": "a batch"}})
    assert ingest_http(ingestor, None, body, "application/json").status is ApplyStatus.MALFORMED
    assert ingestor.stats.dropped["malformed"] == 1
    assert ingestor.expected_seq("r") == 1


@pytest.mark.parametrize(
    ("replica", "body", "content_type", "seq"),
    [
        ("r", b"\x90", "application/msgpack", None),
        (None, b"\x90", "application/msgpack", 0),
        ("r", b"{", "application/json", None),
        (None, b'{"seq": 0, "batch": [1.0, []]}', "application/json", None),
        ("x", b'{"replica": "r", "seq": 0, "batch": [1.0, []]}', "application/json", None),
        ("r", b"", "text/plain", 0),
    ],
)
def test_unusable_requests_raise_a_clear_error(setup, replica, body, content_type, seq) -> None:
    _, ingestor = setup
    with pytest.raises(HttpIngestError):
        ingest_http(ingestor, replica, body, content_type, seq=seq)
