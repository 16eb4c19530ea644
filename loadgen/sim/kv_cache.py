"""The paged KV cache of one replica: a GPU block pool with vLLM's prefix-caching rules, and an optional CPU tier.

Rules kept from vLLM's ``BlockPool``: only full blocks are cached, a block is found by its chained hash, blocks held by
running requests are pinned (reference counted), and unreferenced cached blocks stay reusable until evicted in LRU
order (a finished request's blocks are queued tail first, so its last blocks go first). Every change is appended to
``events`` as vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``; the engine publishes them once per step.
With a CPU tier, a request's blocks are written there as well once computed (``BlockStored`` CPU: vLLM's offloading
connector stores each step's newly computed blocks), the tier evicting its own least recently used blocks, so a block
the GPU evicts later is loaded back from the CPU instead of recomputed. When the request ends, its blocks there become
the tier's most recent (the connector's ``on_request_finished``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from .block_hash import BlockKey
from .wire import AllBlocksCleared, BlockRemoved, BlockStored

GPU = "GPU"
CPU = "CPU"


@dataclass(slots=True)
class CachedBlock:
    key: BlockKey
    block_id: int
    ref_count: int = 0


@dataclass(slots=True)
class Allocation:
    """The blocks one request holds: cached blocks it pins (in chain order) and private (uncached) slots."""

    pinned: list[CachedBlock] = field(default_factory=list)
    private_slots: int = 0


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Leading blocks of a chain found in each tier; a chain stops at its first miss."""

    gpu_blocks: int
    cpu_blocks: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cpu_capacity = cpu_blocks
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self.free_slots = num_blocks
        self.gpu: dict[bytes, CachedBlock] = {}
        self.evictable: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self.cpu: OrderedDict[bytes, BlockKey] = OrderedDict()
        self._next_block_id = 0
        self.evicted_blocks = 0

    # --- queries -------------------------------------------------------------------------------------------------
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of blocks neither free nor evictable."""
        return (self.num_blocks - self.free_slots - len(self.evictable)) / self.num_blocks

    def in_use(self) -> bool:
        """Whether any block is held (by a request or a lease): vLLM refuses a prefix-cache reset then."""
        return self.free_slots + len(self.evictable) < self.num_blocks

    def available(self) -> int:
        return self.free_slots + len(self.evictable)

    def match(self, chain: list[BlockKey], max_blocks: int) -> PrefixHit:
        gpu = 0
        while gpu < max_blocks and chain[gpu].block_hash in self.gpu:
            gpu += 1
        cpu = 0
        while gpu + cpu < max_blocks and chain[gpu + cpu].block_hash in self.cpu:
            cpu += 1
        return PrefixHit(gpu, cpu)

    # --- allocation ----------------------------------------------------------------------------------------------
    def pin(self, alloc: Allocation, keys: Iterable[BlockKey]) -> None:
        """Reference cached GPU blocks (prefix hits): they leave the eviction queue while pinned."""
        for key in keys:
            block = self.gpu[key.block_hash]
            if block.ref_count == 0:
                self.evictable.pop(key.block_hash, None)
            block.ref_count += 1
            alloc.pinned.append(block)

    def allocate(self, alloc: Allocation, n: int) -> bool:
        """Give ``n`` private slots to a request, evicting LRU unreferenced blocks if needed; False if they do not fit."""
        if n > self.available():
            return False
        while self.free_slots < n:
            self._evict_one()
        self.free_slots -= n
        alloc.private_slots += n
        return True

    def commit(self, alloc: Allocation, keys: list[BlockKey], session_id: str | None = None) -> None:
        """Turn private slots holding newly computed (or loaded) full blocks into cached blocks and announce them
        (vLLM 0.33 stamps the request's session id on its events).

        A hash already cached (another request computed it concurrently) stays private and unannounced."""
        run: list[BlockKey] = []
        for key in keys:
            if key.block_hash in self.gpu or alloc.private_slots == 0:
                self._announce(run, GPU, session_id)
                run = []
                continue
            alloc.private_slots -= 1
            block = CachedBlock(key, self._new_block_id(), ref_count=1)
            self.gpu[key.block_hash] = block
            alloc.pinned.append(block)
            run.append(key)
        self._announce(run, GPU, session_id)

    def release(self, alloc: Allocation) -> None:
        """Drop a request's hold; its cached blocks become evictable, tail first (vLLM frees blocks in reverse), and
        those the CPU tier holds become its most recent."""
        if self.cpu_capacity > 0:
            self.touch_cpu([block.key for block in alloc.pinned if block.key.block_hash in self.cpu])
        self.free_slots += alloc.private_slots
        alloc.private_slots = 0
        for block in reversed(alloc.pinned):
            h = block.key.block_hash
            if self.gpu.get(h) is not block:  # forgotten by a prefix-cache reset while pinned: the slot is private
                self.free_slots += 1
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                self.evictable[h] = block
        alloc.pinned.clear()

    def touch_cpu(self, keys: list[BlockKey]) -> None:
        """Make CPU-tier blocks a request uses the most recent there, head last (the tier evicts tails first)."""
        for key in reversed(keys):
            self.cpu.move_to_end(key.block_hash)

    def offload(self, keys: list[BlockKey]) -> None:
        """Write blocks a request has computed (in chain order) to the CPU tier, if there is one. Each run of blocks not
        there yet is announced as one ``BlockStored``, after the evictions that made room for it; those already there
        are made recent first, so this write does not evict them, and the whole run is the most recent after it, head
        last."""
        if self.cpu_capacity == 0:
            return
        self.touch_cpu([key for key in keys if key.block_hash in self.cpu])
        run: list[BlockKey] = []
        for key in keys:
            if key.block_hash in self.cpu:
                self._store_cpu(run)
                run = []
            else:
                run.append(key)
        self._store_cpu(run)
        self.touch_cpu([key for key in keys if key.block_hash in self.cpu])

    def reset(self, announce: bool = True) -> None:
        """Forget every cached block (vLLM's ``reset_prefix_cache``). Pinned blocks stay allocated as private slots."""
        self.free_slots += len(self.evictable)
        self.evictable.clear()
        self.gpu.clear()
        self.cpu.clear()
        if announce:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self.events = self.events, []
        return events

    # --- internals -----------------------------------------------------------------------------------------------
    def _new_block_id(self) -> int:
        self._next_block_id += 1
        return self._next_block_id

    def _evict_one(self) -> None:
        h, block = self.evictable.popitem(last=False)
        del self.gpu[h]
        self.free_slots += 1
        self.evicted_blocks += 1
        self.events.append(BlockRemoved(block_hashes=[block.key.event_hash], medium=GPU))

    def _store_cpu(self, run: list[BlockKey]) -> None:
        if not run:
            return
        run = run[: self.cpu_capacity]  # a chain longer than the whole tier keeps its head
        overflow = len(self.cpu) + len(run) - self.cpu_capacity
        if overflow > 0:
            gone = [self.cpu.popitem(last=False)[1] for _ in range(overflow)]
            self.events.append(BlockRemoved(block_hashes=[key.event_hash for key in gone], medium=CPU))
        for key in reversed(run):
            self.cpu[key.block_hash] = key
        self._announce(run, CPU)

    def _announce(self, run: list[BlockKey], medium: str, session_id: str | None = None) -> None:
        if not run:
            return
        salted = any(k.salted for k in run)
        self.events.append(
            BlockStored(
                block_hashes=[k.event_hash for k in run],
                parent_block_hash=run[0].parent_event_hash,
                token_ids=[t for k in run for t in k.token_ids],
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                extra_keys=[k.event_extra_keys for k in run] if salted else None,
                session_id=session_id,
            )
        )
