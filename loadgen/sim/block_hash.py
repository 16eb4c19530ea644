"""vLLM's prefix-cache block hash (``sha256`` algorithm, the default since vLLM 0.10.2).

``hash_i = sha256(pickle((hash_{i-1} or NONE_HASH, tuple(block_i_tokens), extra_keys_i)))`` with NONE_HASH =
sha256(pickle("vllm-none-hash")) (vLLM >= 0.29 when PYTHONHASHSEED is unset). A cache_salt enters block 0 only, as the
extra key ``("cache_salt", salt)``; events publish it untagged (``(salt,)``) and publish each 32-byte hash as its low
64 bits. Reproducing the engine's own hash keeps the simulated events byte-identical to a real vLLM's.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Sequence

NONE_HASH_SEED = "vllm-none-hash"
PICKLE_PROTOCOL = 5


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


NONE_HASH = sha256_pickle(NONE_HASH_SEED)


def event_hash(block_hash: bytes) -> int:
    """The published form of a hash (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` default): last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One full block of a request's token sequence: its hash, its parent's, its tokens and its published extra keys."""

    block_hash: bytes
    event_hash: int
    parent_event_hash: int | None
    token_ids: tuple[int, ...]
    event_extra_keys: tuple | None
    salted: bool
    """The request had a cache_salt: its events carry ``extra_keys`` (one entry per block, None after block 0)."""


def next_block(
    parent: BlockKey | None, tokens: Sequence[int], cache_salt: str | None = None, none_hash: bytes = NONE_HASH
) -> BlockKey:
    """The key of the full block after ``parent`` (None: block 0, which alone carries the salt)."""
    first = parent is None
    salted = cache_salt is not None and first
    extra = (("cache_salt", cache_salt),) if salted else None
    h = sha256_pickle((none_hash if parent is None else parent.block_hash, tuple(tokens), extra))
    return BlockKey(
        h, event_hash(h), None if parent is None else parent.event_hash, tuple(tokens),
        (cache_salt,) if salted else None, cache_salt is not None,
    )


def block_chain(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, none_hash: bytes = NONE_HASH
) -> list[BlockKey]:
    """The hash chain of every full block of ``token_ids`` (a trailing partial block is never hashed)."""
    chain: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain[-1] if chain else None
        chain.append(next_block(parent, token_ids[start : start + block_size], cache_salt, none_hash))
    return chain
