"""The global prefix index: which replica holds which block, in which tier, under which generation.

Layout, chosen for memory (≤150 bytes per (block, replica) holding) and lookup speed:

- replicas are interned to small slot numbers; a block's holders are one int bitmask with bit ``slot * 3 + tier``,
  stored in one dict ``key → mask`` (a 64-bit key, a small int and one dict entry per block, shared by every
  replica that holds it);
- eviction is CLOCK (second chance) over the dict's insertion order: a store inserts a chain head last, so older
  chains and chain leaves sit at the front; a lookup only adds its matched keys to a "recently matched" set (one C
  call, no reordering of the big dict on the request path); eviction walks from the front, moves recently matched
  keys to the back once (clearing their mark) and evicts the rest. So least recently matched chains go first, from
  their leaves. The set is bounded (cleared when it outgrows half the index), at worst falling back to FIFO;
- a holding's generation is its replica's current generation (the index drops every holding of a replica whose
  generation moves on, so no holding of an old generation survives), and its ``since`` is kept per replica
  generation, not per block (``ReplicaHoldings.since``);
- dropping a replica is O(1): its slot is retired (masked out of every read, its count subtracted) and the replica
  gets a fresh slot on its next write. Retired bits are swept from the dict in one pass once ``_SWEEP_AFTER`` slots
  are retired, and only then are those slot numbers reused;
- each replica's GPU holdings are also kept in an approximate least-recently-used order (a dict per replica, about
  50 bytes per holding): a store or a dispatch of the prompt to that replica moves its blocks to the back, head
  last, as vLLM queues a finished request's blocks for eviction tail first. A replica whose cache is full evicts
  from the front of that order, so its front is what the next allocations there will evict
  (:meth:`PrefixIndex.surviving_blocks`);
- predicted holdings live apart, ``key → mask`` (bit ``slot * 3``, the slot's GPU position, so it lines up with
  the tier masks) with a deadline per (slot, key), and are swept at each lookup, so they are never trusted past
  their TTL.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from kvgate.cache_index.match import PrefixMatch, Tier

_TIERS = len(Tier)
_SLOT_BITS = (1 << _TIERS) - 1
_SWEEP_AFTER = 8
"""Retired slots accumulated before one sweep of the index clears their bits."""
_EVICTION_HEADROOM = 0.01
"""Evict this fraction of the cap below it at once, so a full index does not evict on every store."""


class Survivors(NamedTuple):
    """What a replica will still hold of a prefix once the blocks on their way there are allocated."""

    blocks: int
    """Leading blocks it will still hold, in some tier."""
    cpu_blocks: int = 0
    """Of those, blocks it holds on its GPU now but will then hold only in its CPU tier."""
    storage_blocks: int = 0
    """Likewise, only in its storage tier."""


@dataclass(slots=True)
class IndexStats:
    entries: int
    """(block, replica, tier) holdings confirmed by events."""
    blocks: int
    """Distinct block keys held by at least one replica."""
    approx_bytes: int
    """Estimated memory of the confirmed holdings (dict, keys, masks)."""
    evictions: int
    """Holdings evicted because the index was above ``max_entries``."""
    predicted_entries: int
    """(block, replica) predictions not yet confirmed nor expired."""
    replicas: int


@dataclass(slots=True)
class ReplicaHoldings:
    """A replica's view in the index: its current generation and when that generation began."""

    generation: int
    since: float
    evicting: bool = False
    """The engine has evicted a GPU block since its cache was last empty (started or cleared): its never-used blocks
    are gone, so every new block it allocates evicts a cached one."""


class PrefixIndex:
    """Per block, the replicas holding it per tier; per prompt, each replica's longest cached prefix."""

    def __init__(
        self, max_entries: int = 5_000_000, predicted_ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.predicted_ttl_s = predicted_ttl_s
        self._clock = clock
        self._holders: dict[int, int] = {}
        self._recently_matched: set[int] = set()
        self._entries = 0
        self._evictions = 0
        self._slots: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._retired_slots: list[int] = []
        self._live = 0
        """Bits of every live slot (3 per slot): holders' bits outside it belong to retired slots."""
        self._live_gpu = 0
        """The GPU bit of every live slot: the pattern lookups read tier masks through."""
        self._tier_entries: dict[int, list[int]] = {}
        """Per slot, its holdings in each tier."""
        self._lru: dict[int, dict[int, None]] = {}
        """Per slot, its GPU holdings, least recently stored or dispatched first."""
        self._replicas: dict[str, ReplicaHoldings] = {}
        self._predicted: dict[int, int] = {}
        self._predicted_deadlines: dict[int, dict[int, float]] = {}
        self._predicted_expiry: list[tuple[float, int, tuple[int, ...]]] = []
        """A heap of (deadline, slot, keys): predictions expire in deadline order whatever their TTL."""

    # replicas and generations

    def _slot(self, replica: str) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slots[replica] = slot
            self._names[slot] = replica
            self._tier_entries[slot] = [0] * _TIERS
            self._live |= _SLOT_BITS << (slot * _TIERS)
            self._live_gpu |= 1 << (slot * _TIERS)
        return slot

    def generation(self, replica: str) -> int | None:
        holdings = self._replicas.get(replica)
        return None if holdings is None else holdings.generation

    def replica(self, replica: str) -> ReplicaHoldings | None:
        return self._replicas.get(replica)

    def _admit(self, replica: str, generation: int) -> bool:
        """Accept writes of ``generation``: a newer one replaces everything the replica held; an older one is stale."""
        holdings = self._replicas.get(replica)
        if holdings is None:
            self._replicas[replica] = ReplicaHoldings(generation, self._clock())
            return True
        if generation < holdings.generation:
            return False
        if generation > holdings.generation:
            self.drop_replica(replica)
            self._replicas[replica] = ReplicaHoldings(generation, self._clock(), holdings.evicting)
        return True

    # writes

    def store(self, replica: str, keys: Sequence[int], tier: Tier, generation: int) -> None:
        """Record that ``replica`` holds ``keys`` in ``tier``; confirms predictions; ignored for an old generation."""
        holdings = self._replicas.get(replica)
        if (holdings is None or holdings.generation != generation) and not self._admit(replica, generation):
            return
        slot = self._slots.get(replica)
        if slot is None:
            slot = self._slot(replica)
        bit = 1 << (slot * _TIERS + tier)
        holders = self._holders
        added = 0
        for key in reversed(keys):  # the head of the chain ends up the most recent
            mask = holders.pop(key, 0)
            if not mask & bit:
                added += 1
            holders[key] = mask | bit
        self._entries += added
        self._tier_entries[slot][tier] += added
        if tier is Tier.GPU:
            self._refresh(slot, keys, stored=True)
        deadlines = self._predicted_deadlines.get(slot) if self._predicted_deadlines else None
        if deadlines:
            for key in keys:
                if deadlines.pop(key, None) is not None:
                    self._unpredict(key, slot)
        if self._entries > self.max_entries:
            self._evict()

    def remove(self, replica: str, keys: Sequence[int], tier: Tier) -> set[int]:
        """Forget that ``replica`` holds ``keys`` in ``tier``; of ``keys``, those it now holds in no tier."""
        slot = self._slots.get(replica)
        if slot is None:
            return set(keys)
        shift = slot * _TIERS
        bit = 1 << (shift + tier)
        holders = self._holders
        if tier is Tier.GPU:
            lru = self._lru.get(slot)
            if lru is not None:
                for key in keys:
                    lru.pop(key, None)
        removed = 0
        gone: set[int] = set()
        for key in keys:
            mask = holders.get(key, 0)
            if mask & bit:
                removed += 1
                mask &= ~bit
                if mask:
                    holders[key] = mask
                else:
                    del holders[key]
            if not mask >> shift & _SLOT_BITS:
                gone.add(key)
        self._entries -= removed
        self._tier_entries[slot][tier] -= removed
        return gone

    def evicted(self, replica: str) -> None:
        """The engine evicted a GPU block (one kvgate may not know): its cache is full for the rest of the
        generation."""
        holdings = self._replicas.get(replica)
        if holdings is not None:
            holdings.evicting = True

    def touch(self, replica: str, keys: Sequence[int]) -> None:
        """The router sent a prompt of ``keys`` to ``replica``: the engine will use the blocks it holds, so they move
        to the back of its eviction order (head last)."""
        slot = self._slots.get(replica)
        if slot is not None and keys:
            self._refresh(slot, keys, stored=False)

    def _refresh(self, slot: int, keys: Sequence[int], *, stored: bool) -> None:
        lru = self._lru.get(slot)
        if lru is None:
            if not stored:
                return
            lru = self._lru[slot] = {}
        pop = lru.pop
        if stored:
            for key in reversed(keys):
                pop(key, None)
                lru[key] = None
        else:
            for key in reversed(keys):
                if key in lru:
                    del lru[key]
                    lru[key] = None

    def surviving_blocks(
        self, replica: str, keys: Sequence[int], capacity_blocks: int, incoming_blocks: int
    ) -> Survivors:
        """How many leading ``keys`` (a prefix ``replica`` holds) it will still hold once ``incoming_blocks`` more
        blocks are allocated there, which is before a request sent now is scheduled (at least as many as are
        predicted there and not confirmed yet), and how many of those it will then hold only in a lower tier.

        The engine first takes blocks no cached block occupies (``capacity_blocks`` less what it holds, none once
        it has evicted in this generation), then evicts from the front of its LRU queue. kvgate's order is an
        approximation, and the blocks it does not know (forgotten at a reset, stored before it subscribed) sit in
        front of it, so treating its first ``incoming - free`` blocks as lost errs towards crediting less: a lost
        credit is a miss, a credited block the engine evicted is a wrong hit. A block at risk that the replica also
        holds in its CPU or storage tier (an offloading engine writes its blocks there as it computes them) stays
        reusable, loaded from that tier. The engine evicts a chain from its tail, so the prefix is cut at its first
        block at risk that no lower tier holds.
        """
        slot = self._slots.get(replica)
        lru = None if slot is None else self._lru.get(slot)
        holdings = self._replicas.get(replica)
        if not lru or holdings is None or not keys or slot is None:
            return Survivors(len(keys))
        # Blocks predicted there and not yet confirmed were dispatched but their BlockStored, and the BlockRemoved
        # of the same step, have not been applied: they count even once the request has its first token.
        unconfirmed = len(self._predicted_deadlines.get(slot, ()))
        free = 0 if holdings.evicting else max(0, capacity_blocks - len(lru))
        at_risk = max(incoming_blocks, unconfirmed) - free
        if at_risk <= 0:
            return Survivors(len(keys))
        doomed = lru if at_risk >= len(lru) else set(islice(lru, at_risk))
        shift = slot * _TIERS
        cpu_bit, storage_bit = 1 << (shift + Tier.CPU), 1 << (shift + Tier.STORAGE)
        holders = self._holders
        cpu = storage = 0
        for i, key in enumerate(keys):
            if key in doomed:
                mask = holders.get(key, 0)
                if mask & cpu_bit:
                    cpu += 1
                elif mask & storage_bit:
                    storage += 1
                else:
                    return Survivors(i, cpu, storage)
        return Survivors(len(keys), cpu, storage)

    def held_blocks(self, replica: str) -> int:
        """Blocks ``replica`` holds, confirmed by its events, all tiers counted (0 for a replica never seen)."""
        slot = self._slots.get(replica)
        return 0 if slot is None else sum(self._tier_entries[slot])

    def holdings(self, replica: str) -> dict[str, int]:
        """How much ``replica`` holds, counted: confirmed blocks per tier, and blocks predicted there (just routed)
        that its events have not confirmed yet and whose prediction has not expired (zeros for a replica never
        seen). Counts only, for an operator: the keys are hashes of prompts."""
        slot = self._slots.get(replica)
        tiers = [0] * _TIERS if slot is None else self._tier_entries[slot]
        deadlines = None if slot is None else self._predicted_deadlines.get(slot)
        now = self._clock()
        predicted = 0 if not deadlines else sum(1 for deadline in deadlines.values() if deadline > now)
        counts = {f"{tier.name.lower()}_blocks": tiers[tier] for tier in Tier}
        counts["predicted_blocks"] = predicted
        return counts

    def holds(self, replica: str, key: int) -> bool:
        """Whether ``replica`` holds ``key`` in any tier (confirmed holdings only)."""
        slot = self._slots.get(replica)
        if slot is None:
            return False
        return bool(self._holders.get(key, 0) >> (slot * _TIERS) & _SLOT_BITS)

    def drop_replica(self, replica: str) -> int:
        """Remove every holding and prediction of ``replica`` at once; returns how many holdings were removed."""
        slot = self._slots.pop(replica, None)
        if slot is None:
            return 0
        del self._names[slot]
        removed = sum(self._tier_entries.pop(slot))
        self._lru.pop(slot, None)
        self._entries -= removed
        self._live &= ~(_SLOT_BITS << (slot * _TIERS))
        self._live_gpu &= ~(1 << (slot * _TIERS))
        self._retired_slots.append(slot)
        for key in self._predicted_deadlines.pop(slot, {}):
            self._unpredict(key, slot)
        if len(self._retired_slots) >= _SWEEP_AFTER:
            self.sweep()
        return removed

    def sweep(self) -> None:
        """Clear retired slots' bits from every block (one pass over the index) and make the slots reusable."""
        if not self._retired_slots:
            return
        dead = 0
        for slot in self._retired_slots:
            dead |= _SLOT_BITS << (slot * _TIERS)
        holders = self._holders
        emptied: list[int] = []
        for key, mask in holders.items():
            if mask & dead:
                rest = mask & ~dead
                if rest:
                    holders[key] = rest  # assigning an existing key keeps the dict's size and order
                else:
                    emptied.append(key)
        for key in emptied:
            del holders[key]
        self._free_slots.extend(self._retired_slots)
        self._retired_slots.clear()

    def reset_replica(self, replica: str, generation: int, *, wiped: bool = False) -> int:
        """Drop everything ``replica`` holds and start ``generation`` (older writes are ignored from now on).

        Unless the engine's cache was ``wiped`` (a restart, ``AllBlocksCleared``), the engine still holds what kvgate
        forgets, so a replica that was evicting still is."""
        previous = self._replicas.get(replica)
        removed = self.drop_replica(replica)
        evicting = previous is not None and previous.evicting and not wiped
        self._replicas[replica] = ReplicaHoldings(generation, self._clock(), evicting)
        return removed

    def forget_replica(self, replica: str) -> int:
        """Drop the replica's holdings and its generation record (it left the fleet)."""
        removed = self.drop_replica(replica)
        self._replicas.pop(replica, None)
        return removed

    def _evict(self) -> None:
        target = self.max_entries - int(self.max_entries * _EVICTION_HEADROOM)
        holders = self._holders
        recent = self._recently_matched
        while self._entries > target and holders:
            for key in list(islice(holders, 1024)):
                mask = holders.pop(key)
                if key in recent:  # second chance: back of the queue, mark cleared
                    recent.discard(key)
                    holders[key] = mask
                    continue
                live = mask & self._live
                count = live.bit_count()
                self._entries -= count
                self._evictions += count
                while live:
                    low = live & -live
                    bit = low.bit_length() - 1
                    self._tier_entries[bit // _TIERS][bit % _TIERS] -= 1
                    if bit % _TIERS == Tier.GPU:
                        lru = self._lru.get(bit // _TIERS)
                        if lru is not None:
                            lru.pop(key, None)
                    live ^= low
                if self._entries <= target:
                    return

    # predictions

    def predict(self, replica: str, keys: Sequence[int], ttl_s: float | None = None) -> None:
        """Mark ``keys`` as predicted on ``replica`` for ``predicted_ttl_s`` (the router just sent it this prompt), or
        for ``ttl_s`` when shorter (what is left of another gateway's prediction)."""
        ttl = self.predicted_ttl_s if ttl_s is None else min(ttl_s, self.predicted_ttl_s)
        if not keys or ttl <= 0:
            return
        slot = self._slot(replica)
        deadline = self._clock() + ttl
        deadlines = self._predicted_deadlines.setdefault(slot, {})
        predicted = self._predicted
        bit = 1 << (slot * _TIERS)
        confirmed_bits = _SLOT_BITS << (slot * _TIERS)
        fresh: list[int] = []
        for key in keys:
            if self._holders.get(key, 0) & confirmed_bits:
                continue
            if ttl_s is None or deadlines.get(key, 0.0) < deadline:  # a hint never shortens a longer prediction
                deadlines[key] = deadline
            predicted[key] = predicted.get(key, 0) | bit
            fresh.append(key)
        if fresh:
            heapq.heappush(self._predicted_expiry, (deadline, slot, tuple(fresh)))

    def unpredict(self, replica: str, keys: Sequence[int]) -> None:
        """The engine answered without reusing ``keys`` kvgate predicted on ``replica``: drop those predictions
        (confirmed holdings stay; their events settle them)."""
        slot = self._slots.get(replica)
        deadlines = None if slot is None else self._predicted_deadlines.get(slot)
        if not deadlines:
            return
        for key in keys:
            if deadlines.pop(key, None) is not None:
                self._unpredict(key, slot)

    def _unpredict(self, key: int, slot: int) -> None:
        mask = self._predicted.get(key, 0) & ~(1 << (slot * _TIERS))
        if mask:
            self._predicted[key] = mask
        else:
            self._predicted.pop(key, None)

    def _expire_predictions(self, now: float) -> None:
        expiry = self._predicted_expiry
        while expiry and expiry[0][0] <= now:
            _, slot, keys = heapq.heappop(expiry)
            deadlines = self._predicted_deadlines.get(slot)
            if deadlines is None:
                continue
            for key in keys:
                deadline = deadlines.get(key)
                if deadline is not None and deadline <= now:  # a later prediction of the same key keeps it
                    del deadlines[key]
                    self._unpredict(key, slot)

    # reads

    def lookup(self, keys: Sequence[int], block_size: int) -> dict[str, PrefixMatch]:
        """Per replica holding at least block 0: leading tokens held, each block attributed to its best tier.

        A replica's walk stops at its first block held in no tier and not predicted. Matched blocks become the most
        recently used, head last.
        """
        self._expire_predictions(self._clock())
        holders = self._holders
        predicted = self._predicted
        if not self._names or not keys:
            return {}
        gpu_pattern = self._live_gpu
        alive = -1
        runs: list[tuple[int, int, int, int, int]] = []  # (gpu, cpu, storage, predicted) slot masks, blocks
        previous: tuple[int, int, int, int] | None = None
        run_length = 0
        matched = 0
        previous_mask = previous_guess = -1
        get_holders = holders.get
        get_predicted = predicted.get if predicted else None
        for key in keys:
            mask = get_holders(key, 0)
            guess = get_predicted(key, 0) if get_predicted is not None else 0
            if mask == previous_mask and guess == previous_guess:  # the common case: same holders as the last block
                run_length += 1
                matched += 1
                continue
            previous_mask, previous_guess = mask, guess
            gpu = mask & gpu_pattern
            cpu = (mask >> 1) & gpu_pattern & ~gpu
            storage = (mask >> 2) & gpu_pattern & ~gpu & ~cpu
            confirmed = gpu | cpu | storage
            guessed = guess & ~confirmed
            held = (confirmed | guessed) & alive
            if not held:
                break
            alive = held
            current = (gpu & held, cpu & held, storage & held, guessed & held)
            if current == previous:
                run_length += 1
            else:
                if previous is not None:
                    runs.append((*previous, run_length))
                previous = current
                run_length = 1
            matched += 1
        if previous is None:
            return {}
        runs.append((*previous, run_length))
        recent = self._recently_matched
        recent.update(keys[:matched])
        if len(recent) > max(_RECENT_FLOOR, len(holders) // 2):
            recent.clear()
        result: dict[str, PrefixMatch] = {}
        names = self._names
        for gpu, cpu, storage, guessed, length in runs:
            tokens = length * block_size
            for field_name, mask in (("gpu", gpu), ("cpu", cpu), ("storage", storage), ("predicted", guessed)):
                while mask:
                    low = mask & -mask
                    slot = (low.bit_length() - 1) // _TIERS
                    mask ^= low
                    name = names.get(slot)
                    if name is None:
                        continue
                    match = result.get(name)
                    if match is None:
                        match = result[name] = PrefixMatch()
                    setattr(match, field_name, getattr(match, field_name) + tokens)
        return result

    def export_holdings(self, replicas: Sequence[str]) -> dict[str, tuple[array[int], bytearray]]:
        """Per replica (those of ``replicas`` the index knows): its confirmed keys in the index's eviction order,
        least recently used first, and per key a byte whose bit ``t`` says it is held in tier ``t``. One pass over
        the index for all of them."""
        out: dict[str, tuple[array[int], bytearray]] = {}
        shifts: list[tuple[int, array[int], bytearray]] = []
        for name in replicas:
            slot = self._slots.get(name)
            if slot is not None:
                keys, tiers = out[name] = (array("Q"), bytearray())
                shifts.append((slot * _TIERS, keys, tiers))
        if not shifts:
            return out
        for key, mask in self._holders.items():
            for shift, keys, tiers in shifts:
                bits = mask >> shift & _SLOT_BITS
                if bits:
                    keys.append(key)
                    tiers.append(bits)
        return out

    def stats(self) -> IndexStats:
        blocks = len(self._holders)
        return IndexStats(
            entries=self._entries,
            blocks=blocks,
            approx_bytes=blocks * _BYTES_PER_BLOCK,
            evictions=self._evictions,
            predicted_entries=sum(len(d) for d in self._predicted_deadlines.values()),
            replicas=len(self._replicas),
        )


_RECENT_FLOOR = 4096
"""The recently-matched set may always hold this many keys, however small the index."""

_BYTES_PER_BLOCK = 36 + 32 + 48
"""A 64-bit int key, a small int mask and one dict slot with its share of the table (measured with tracemalloc
by benchmarks/bench_index.py)."""

