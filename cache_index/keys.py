"""kvgate's own block keys: chained 64-bit xxh3 hashes over token ids, rooted in a namespace.

The engine's block hashes depend on its hash algorithm, seed and release, so kvgate never tries to reproduce them.
Instead both sides compute the same keys from what they both know: the request side from its token ids, the event
side from the ``token_ids`` every ``BlockStored`` carries. The chain makes a key stand for the whole prefix up to
and including its block, so equal keys mean equal token prefixes in the same namespace.

A namespace (model, weight version, cache salt, LoRA adapter) is the root of every chain: two requests that differ
in any of these can never produce an equal key, so no request can match another tenant's or another model's blocks.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Hashable, Sequence

import msgspec
import xxhash

_NAMESPACE_TAG = "kvgate-namespace-v1"
_encode = msgspec.msgpack.Encoder().encode
_xxh3_64 = xxhash.xxh3_64_intdigest
_TOKEN_BYTES = 4


@functools.lru_cache(maxsize=4096)
def namespace_key(
    model: str, weight_version: str = "", cache_salt: str | None = None, lora_name: str | None = None
) -> int:
    """Root key of every chain for this (model, weight version, cache salt, LoRA) combination (remembered: every
    request asks, and the same few combinations come back)."""
    return _xxh3_64(_encode([_NAMESPACE_TAG, model, weight_version, cache_salt, lora_name]))


def encode_extra_keys(extra: Hashable | Sequence[Hashable] | None) -> bytes | None:
    """Canonical bytes for one block's extra keys (multimodal ids, prompt-embeds digests), or None when it has none.

    Tuples and lists encode alike, so the published (list) and request-side (tuple) forms give the same bytes.
    """
    if extra is None or (isinstance(extra, (tuple, list)) and not extra):
        return None
    return _encode(extra)


def block_keys(
    namespace: int,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[Hashable | None] | None = None,
) -> list[int]:
    """Chained keys of the full blocks of ``token_ids``: key_i = xxh3_64(block i's tokens as uint32, seed=key_{i-1}).

    ``key_{-1}`` is ``namespace``. A block with extra keys hashes with a seed derived from its parent and the extra
    keys' canonical bytes, so it can never equal the same tokens without them. A trailing partial block gets no key:
    engines only cache full blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    packed = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    view = packed.tobytes()  # slicing bytes is cheaper than slicing a memoryview for 64-byte blocks
    stride = block_size * _TOKEN_BYTES
    keys: list[int] = []
    parent = namespace
    if extra_keys is None:
        for start in range(0, n_blocks * stride, stride):
            parent = _xxh3_64(view[start : start + stride], parent)
            keys.append(parent)
        return keys
    for i in range(n_blocks):
        extra = encode_extra_keys(extra_keys[i]) if i < len(extra_keys) else None
        seed = parent if extra is None else _xxh3_64(extra, parent)
        parent = _xxh3_64(view[i * stride : (i + 1) * stride], seed)
        keys.append(parent)
    return keys
