"""The tokenizer's cache of prompt pieces' token ids, kept per model and namespace (the request's cache salt)."""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from threading import Lock
from typing import Sequence


class PieceCache:
    """LRU of (scope, prompt piece) → token ids, bounded by an estimate of the memory it holds. The scope is the model
    and the request's namespace (:func:`cache_scope`): a piece another tenant sent is never a hit, so the time a
    request takes to tokenize says nothing about what other tenants sent.

    Ids are stored as ``array('I')`` (4 bytes per token instead of ~36 for a list of ints). Thread-safe: the worker
    threads look up and fill it under one lock, a few dictionary operations per piece.
    """

    ENTRY_OVERHEAD = 200
    """Bytes per entry beyond the key text and the ids: tuple, array header, OrderedDict node."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._lock = Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, keys: Sequence[tuple[str, str]]) -> list[array[int] | None]:
        found: list[array[int] | None] = []
        with self._lock:
            for key in keys:
                ids = self._entries.get(key)
                if ids is not None:
                    self._entries.move_to_end(key)
                found.append(ids)
            hits = sum(ids is not None for ids in found)
            self.hits += hits
            self.misses += len(keys) - hits
        return found

    def put_many(self, items: Sequence[tuple[tuple[str, str], array[int]]]) -> None:
        with self._lock:
            for key, ids in items:
                size = self._size(key, ids)
                if size > self.max_bytes or key in self._entries:
                    continue
                self._entries[key] = ids
                self.bytes += size
            while self.bytes > self.max_bytes:
                old_key, old_ids = self._entries.popitem(last=False)
                self.bytes -= self._size(old_key, old_ids)
                self.evictions += 1

    def _size(self, key: tuple[str, str], ids: array[int]) -> int:
        return sys.getsizeof(key[1]) + ids.itemsize * len(ids) + self.ENTRY_OVERHEAD


