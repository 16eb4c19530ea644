"""The block pool: prefix reuse of full blocks, pinning, LRU eviction (tail first), the CPU tier, reset — and the
vLLM events each of those emits."""

from __future__ import annotations

from kvgate.loadgen.sim.block_hash import block_chain
from kvgate.loadgen.sim.kv_cache import Allocation, BlockPool, PrefixHit
from kvgate.loadgen.sim.wire import AllBlocksCleared, BlockRemoved, BlockStored


def fill(pool: BlockPool, tokens: list[int], salt: str | None = None) -> Allocation:
    """A request that computes all full blocks of ``tokens`` (cached, and written to the CPU tier if there is one)."""
    chain = block_chain(tokens, pool.block_size, salt)
    alloc = Allocation()
    assert pool.allocate(alloc, len(chain))
    pool.commit(alloc, chain)
    pool.offload(chain)
    return alloc


def test_commit_announces_one_event_per_run() -> None:
    pool = BlockPool(8, 4)
    alloc = fill(pool, list(range(12)))
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == list(range(12))
    assert len(event.block_hashes) == 3 and event.parent_block_hash is None
    assert event.medium == "GPU" and event.block_size == 4 and event.extra_keys is None
    assert pool.usage() == 3 / 8
    pool.release(alloc)
    assert pool.usage() == 0.0  # cached but evictable counts as free, as in vLLM
    assert pool.match(block_chain(list(range(12)), 4), 3).gpu_blocks == 3


def test_salted_event_has_one_extra_key_per_block() -> None:
    pool = BlockPool(8, 4)
    fill(pool, list(range(8)), "tenant-a")
    (event,) = pool.take_events()
    assert event.extra_keys == [("tenant-a",), None]


def test_lru_eviction_spares_pinned_blocks_and_evicts_tail_first() -> None:
    pool = BlockPool(4, 4)
    old = fill(pool, list(range(8)))  # 2 blocks
    pinned = fill(pool, list(range(100, 108)))  # 2 blocks, still held
    pool.release(old)
    pool.take_events()
    chain_old = block_chain(list(range(8)), 4)
    alloc = Allocation()
    assert pool.allocate(alloc, 1)
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert removed.block_hashes == [chain_old[1].event_hash]  # the request's last block goes first
    assert not pool.allocate(alloc, 2)  # only one evictable block left; pinned ones never go
    assert pool.match(block_chain(list(range(100, 108)), 4), 2).gpu_blocks == 2
    pool.release(pinned)


def test_hit_removes_block_from_eviction_queue() -> None:
    pool = BlockPool(2, 4)
    pool.release(fill(pool, list(range(8))))
    chain = block_chain(list(range(8)), 4)
    alloc = Allocation()
    pool.pin(alloc, chain[:1])
    assert pool.available() == 1
    pool.release(alloc)
    assert pool.available() == 2


def test_computed_blocks_are_written_to_the_cpu_tier_which_evicts_its_lru() -> None:
    """A request's blocks go to the CPU tier once computed, while it still runs (vLLM's offloading connector stores
    each step's newly computed blocks), so the GPU's later eviction leaves them loadable; the CPU tier evicts its own
    oldest blocks."""
    pool = BlockPool(1, 4, cpu_blocks=1)
    running = fill(pool, [1, 2, 3, 4])
    events = pool.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", "GPU"), ("BlockStored", "CPU")]
    pool.release(running)
    assert pool.take_events() == []  # the end of the request writes nothing more
    assert events[1].token_ids == [1, 2, 3, 4] and events[1].parent_block_hash is None
    pool.release(fill(pool, [5, 6, 7, 8]))  # evicts [1..4] from the GPU; the CPU tier makes room for [5..8]
    events = pool.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockRemoved", "GPU"), ("BlockStored", "GPU"), ("BlockRemoved", "CPU"), ("BlockStored", "CPU")]
    assert pool.match(block_chain([1, 2, 3, 4, 0], 4), 1) == PrefixHit(0, 0)
    assert pool.match(block_chain([5, 6, 7, 8, 0], 4), 1) == PrefixHit(1, 0)
    pool.allocate(Allocation(), 1)  # the GPU evicts [5..8]: still in the CPU tier
    assert [(type(e).__name__, e.medium) for e in pool.take_events()] == [("BlockRemoved", "GPU")]
    assert pool.match(block_chain([5, 6, 7, 8, 0], 4), 1) == PrefixHit(0, 1)


def test_the_cpu_tier_keeps_a_used_chain_and_evicts_tails_first() -> None:
    pool = BlockPool(8, 4, cpu_blocks=3)
    first = block_chain(list(range(8)), 4)
    other = block_chain([50, 51, 52, 53], 4)
    pool.release(fill(pool, list(range(8))))
    pool.release(fill(pool, [50, 51, 52, 53]))
    pool.touch_cpu(first)  # used again: the most recent, head last
    pool.take_events()

    def cpu_removed() -> list[list[int]]:
        return [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved) and e.medium == "CPU"]

    pool.release(fill(pool, [100, 101, 102, 103]))
    assert cpu_removed() == [[other[0].event_hash]]
    pool.release(fill(pool, [200, 201, 202, 203]))
    assert cpu_removed() == [[first[1].event_hash]]  # the chain's tail before its head
    assert first[0].block_hash in pool.cpu and first[1].block_hash not in pool.cpu


def test_a_chain_extended_past_what_the_cpu_tier_holds_keeps_its_head_there() -> None:
    """A request that reuses a chain the CPU tier holds and adds blocks of its own: the tier's evictions for the new
    blocks take other chains' blocks, and then the new blocks' own tail, never the chain's head."""
    pool = BlockPool(8, 4, cpu_blocks=3)
    head = block_chain(list(range(8)), 4)
    pool.release(fill(pool, list(range(8))))
    pool.release(fill(pool, [50, 51, 52, 53]))
    pool.take_events()
    longer = block_chain(list(range(12)), 4)
    alloc = Allocation()
    pool.pin(alloc, head)
    assert pool.allocate(alloc, 1)
    pool.commit(alloc, longer[2:])
    pool.offload(longer)  # the step computed the new block: the request's whole chain goes to the tier
    pool.release(alloc)
    assert all(key.block_hash in pool.cpu for key in head)
    assert list(pool.cpu)[-1] == head[0].block_hash  # the head is the most recent
    pool.release(fill(pool, [60, 61, 62, 63]))
    assert longer[2].block_hash not in pool.cpu and head[0].block_hash in pool.cpu


def test_reset_clears_everything_with_one_event() -> None:
    pool = BlockPool(4, 4)
    held = fill(pool, list(range(8)))
    pool.take_events()
    pool.reset()
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]
    assert pool.match(block_chain(list(range(8)), 4), 2).gpu_blocks == 0
    pool.release(held)  # blocks forgotten while pinned come back as free slots
    assert pool.free_slots == 4


def test_duplicate_hash_stays_private() -> None:
    pool = BlockPool(4, 4)
    first = fill(pool, [1, 2, 3, 4])
    second = fill(pool, [1, 2, 3, 4])
    events = pool.take_events()
    assert len(events) == 1
    pool.release(first)
    pool.release(second)
    assert pool.free_slots + len(pool.evictable) == 4


def test_release_after_reset_leaves_a_recached_block_alone() -> None:
    pool = BlockPool(4, 4)
    old = fill(pool, [1, 2, 3, 4])
    pool.reset()
    new = fill(pool, [1, 2, 3, 4])  # the same hash, cached again by another request
    pool.release(old)
    chain = block_chain([1, 2, 3, 4, 0], 4)
    assert pool.gpu[chain[0].block_hash].ref_count == 1, "the old holder must not unpin the new block"
    assert not pool.evictable
    pool.release(new)
    assert pool.free_slots + len(pool.evictable) == 4
