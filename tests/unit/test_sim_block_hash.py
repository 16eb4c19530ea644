"""The sim's block hash is vLLM 0.33's ``sha256`` hash: same NONE_HASH, chain, salt rule and published int form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.loadgen.sim.block_hash import NONE_HASH, block_chain, event_hash, sha256_pickle


def sha256_cases(vectors_dir: Path) -> list[dict]:
    cases = json.loads((vectors_dir / "vllm-block-hashes.json").read_text())["cases"]
    return [c for c in cases if c["algo"] == "sha256"]


def test_vectors_match(vectors_dir: Path) -> None:
    cases = sha256_cases(vectors_dir)
    assert len(cases) >= 4
    for case in cases:
        none_hash = sha256_pickle(case["none_hash_seed"])
        assert none_hash.hex() == case["none_hash_hex"]
        chain = block_chain(case["token_ids"], case["block_size"], case["cache_salt"], none_hash)
        assert [k.block_hash.hex() for k in chain] == case["block_hashes_hex"]
        assert [k.event_hash for k in chain] == case["block_hashes_int64"]


def test_default_seed_is_vllm_none_hash(vectors_dir: Path) -> None:
    case = next(c for c in sha256_cases(vectors_dir) if c["none_hash_seed"] == "vllm-none-hash")
    assert NONE_HASH.hex() == case["none_hash_hex"]


def test_chain_links_parents_and_skips_partial_block() -> None:
    chain = block_chain(list(range(1000, 1040)), 16)
    assert len(chain) == 2  # 40 tokens: two full blocks, the partial third is never hashed
    assert chain[0].parent_event_hash is None
    assert chain[1].parent_event_hash == chain[0].event_hash
    assert chain[1].token_ids == tuple(range(1016, 1032))
    assert event_hash(chain[0].block_hash) == chain[0].event_hash


@pytest.mark.parametrize("salt", ["tenant-a", "b"])
def test_salt_marks_block_zero_only(salt: str) -> None:
    chain = block_chain(list(range(48)), 16, salt)
    assert [k.event_extra_keys for k in chain] == [(salt,), None, None]
    assert all(k.salted for k in chain)
    unsalted = block_chain(list(range(48)), 16)
    assert all(a.block_hash != b.block_hash for a, b in zip(chain, unsalted))
    assert not any(k.salted for k in unsalted)
