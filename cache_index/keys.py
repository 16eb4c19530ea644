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
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import msgspec
import numpy as np
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


def common_prefix(a: array[int], b: array[int]) -> int:
    """How many leading ids ``a`` and ``b`` (typecode ``"I"``) share: one vectorised comparison over views of their
    buffers, no copy (slicing two 100k-token arrays to compare them cost more than hashing their blocks)."""
    assert a.typecode == b.typecode == "I"
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.frombuffer(a, dtype=np.uint32, count=n) != np.frombuffer(b, dtype=np.uint32, count=n)
    first = int(differs.argmax())
    return first if differs[first] else n


REUSE_MIN_BLOCKS = 128
"""Prompts of fewer full blocks are hashed whole and not remembered: below this, copying and comparing token ids
costs about what hashing them does (``benchmarks/bench_index.py``)."""


class RecentBlockKeys:
    """Recent prompts' block keys, so a prompt that extends one of them (a chat's or an agent's next turn, a document
    asked about again) hashes only the blocks past what they share.

    Reuse is exact: a block's key depends only on the namespace and the token ids up to the end of its block, so the
    keys of the full blocks two prompts share are equal, and are taken from the remembered prompt after comparing
    token ids (in C). A prompt is looked up under its session, when it has one, then under its first block's key
    unless its session's last prompt already gave all its keys; it takes the keys of the longer agreement. Remembered
    per namespace (the chain's root), so one tenant's prompts are never compared with another's. Short prompts (under
    ``min_blocks`` blocks) are simply hashed. Bounded in bytes, least recently used out first. The token id arrays
    are kept, not copied (a tokenized prompt's ids are never modified), and the keys are tuples, shared by the cache
    and its callers. Not thread-safe: the event loop uses it.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, min_blocks: int = REUSE_MIN_BLOCKS) -> None:
        self.max_bytes = max_bytes
        self.min_blocks = max(1, min_blocks)
        self._entries: OrderedDict[tuple[int, int, object], tuple[array[int], tuple[int, ...]]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the remembered token ids and keys take, about (an entry under two anchors counts twice)."""
        return self._bytes

    def keys(
        self, namespace: int, token_ids: Sequence[int], block_size: int, session: str | None = None
    ) -> Sequence[int]:
        """:func:`block_keys` of ``token_ids`` under ``namespace``, hashing only the blocks past the longest prefix
        shared with a remembered prompt; the prompt and its keys are then remembered."""
        n_blocks = len(token_ids) // block_size if block_size > 0 else 0
        if n_blocks < self.min_blocks:
            return block_keys(namespace, token_ids, block_size)
        if not (isinstance(token_ids, array) and token_ids.typecode == "I"):
            token_ids = array("I", token_ids)
        first = _xxh3_64(token_ids[:block_size].tobytes(), namespace)
        anchors: tuple[object, ...] = (first,) if session is None else (("session", session), first)
        reused: tuple[int, ...] = ()
        for anchor in anchors:
            entry = self._entries.get((namespace, block_size, anchor))
            if entry is None:
                continue
            held = entry[1]
            shared = min(common_prefix(entry[0], token_ids) // block_size, n_blocks, len(held))
            if shared > len(reused):
                reused = held if shared == len(held) else held[:shared]
            if shared == len(held):
                break  # it extends that prompt: no other can give more of its keys
        if len(reused) == n_blocks:
            keys = reused
        else:
            parent = reused[-1] if reused else namespace
            keys = reused + tuple(block_keys(parent, token_ids[len(reused) * block_size :], block_size))
        remembered = (token_ids, keys)
        for anchor in anchors:
            self._put((namespace, block_size, anchor), remembered)
        return keys

    def _put(self, key: tuple[int, int, object], entry: tuple[array[int], tuple[int, ...]]) -> None:
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self._bytes -= _entry_bytes(old)
        size = _entry_bytes(entry)
        if size > self.max_bytes:
            return
        entries[key] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._bytes -= _entry_bytes(entries.popitem(last=False)[1])


def _entry_bytes(entry: tuple[array[int], tuple[int, ...]]) -> int:
    """4 bytes a token id; a key is a tuple slot and a Python int."""
    return 4 * len(entry[0]) + 40 * len(entry[1])
