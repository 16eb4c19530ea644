"""The replica scheduler on its model clock (time_scale 0, no sockets): TTFT = queue wait + prefill of uncached
tokens, chunked prefill, memory-bound admission, aborts, restarts, CPU-tier loads and NIXL-style transfers."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

import pytest

from kvgate.loadgen.sim.block_hash import block_chain
from kvgate.loadgen.sim.engine import Engine, RemoteSource, SimRequest, State
from kvgate.loadgen.sim.params import SimParams
from tests.support import wait_until_async

BS = 16


class Harness:
    def __init__(self, **overrides: object) -> None:
        self.params = SimParams(model="m", time_scale=0.0, block_size=BS, **overrides)  # type: ignore[arg-type]
        self.batches: dict[str, list[list]] = {}
        self.peers: dict[str, Engine] = {}
        self.engines: list[Engine] = []
        self.tasks: list[asyncio.Task[None]] = []

    def engine(self) -> Engine:
        name = f"e{len(self.engines)}"
        self.batches[name] = []
        e = Engine(self.params, self.batches[name].append, list(range(100, 200)), self.peers, 9000)
        self.engines.append(e)
        self.tasks.append(asyncio.create_task(e.run()))
        return e

    def events(self, i: int) -> list:
        return [ev for batch in self.batches[f"e{i}"] for ev in batch]


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness()
    yield harness
    for t in harness.tasks:
        t.cancel()
    await asyncio.gather(*harness.tasks, return_exceptions=True)


def request(tokens: list[int], max_tokens: int = 4, salt: str | None = None, **kw: object) -> SimRequest:
    chain = block_chain(tokens, BS, salt)
    return SimRequest(request_id=f"r{id(tokens)}-{len(tokens)}", prompt_len=len(tokens), max_tokens=max_tokens,
                      chain=chain, cache_salt=salt, tail_tokens=tokens[len(chain) * BS:], **kw)  # type: ignore[arg-type]


async def until(req: SimRequest, done: Callable[[SimRequest], bool], timeout: float = 5.0) -> SimRequest:
    """Wait for ``req`` to change until ``done(req)``: the engine signals each token of a streaming request and
    the end of every request."""
    async def wait() -> None:
        while not done(req):
            req.changed.clear()
            await req.changed.wait()
    await asyncio.wait_for(wait(), timeout)
    return req


async def finish(req: SimRequest, timeout: float = 5.0) -> SimRequest:
    return await until(req, lambda r: r.finished, timeout)


def ttft(req: SimRequest) -> float:
    assert req.first_token_clock_ms is not None
    return req.first_token_clock_ms - req.arrival_clock_ms


async def test_repeat_prompt_hits_cache_and_is_faster(h: Harness) -> None:
    e = h.engine()
    tokens = list(range(1000, 3000))
    first = await finish(_submit(e, request(tokens)))
    second = await finish(_submit(e, request(list(tokens))))
    assert first.state is State.COMPLETED and len(first.output) == 4
    assert first.cached_tokens == 0
    assert second.cached_tokens == (len(tokens) - 1) // BS * BS
    p = h.params
    assert ttft(first) == pytest.approx(p.step_overhead_ms + p.request_overhead_ms + p.prefill_ms_per_token * 2000)
    assert ttft(second) < ttft(first) - 60  # 1984 cached tokens save ~69 ms of prefill
    assert e.stats.prefix_cache_hits == second.cached_tokens


async def test_generated_blocks_are_cached_for_the_next_turn(h: Harness) -> None:
    e = h.engine()
    prompt = list(range(4000, 4040))  # 2 full blocks + 8 tokens
    first = await finish(_submit(e, request(prompt, max_tokens=30, salt="s")))
    stored = [ev for ev in h.events(0) if type(ev).__name__ == "BlockStored"]
    # 40 + 29 tokens with computed KV (the last sampled token never is): 4 full blocks, 2 of them after the prompt
    assert sum(len(ev.block_hashes) for ev in stored) == 4
    assert stored[-1].token_ids[-16:] == (prompt + first.output)[48:64]
    assert stored[-1].extra_keys == [None]  # salted request, block > 0
    follow_up = prompt + first.output + [5000, 5001, 5002]
    turn2 = await finish(_submit(e, request(follow_up, max_tokens=1, salt="s")))
    assert turn2.cached_tokens == 64
    other_salt = await finish(_submit(e, request(list(follow_up), max_tokens=1, salt="t")))
    assert other_salt.cached_tokens == 0


async def test_long_prompt_is_prefilled_in_chunks() -> None:
    harness = Harness(token_budget=512)
    e = harness.engine()
    try:
        req = await finish(_submit(e, request(list(range(2000)), max_tokens=2)))
        assert e.stats.steps == 4 + 1  # ceil(2000 / 512) prefill steps, then one decode step
        assert req.output and len(req.output) == 2
    finally:
        for t in harness.tasks:
            t.cancel()


async def test_queue_wait_counts_in_ttft(h: Harness) -> None:
    e = h.engine()
    reqs = [_submit(e, request(list(range(i * 10_000, i * 10_000 + 4000)), max_tokens=1)) for i in range(3)]
    for r in reqs:
        await finish(r)
    # One 8192-token budget per step: the third prompt waits for part of the first two to be prefilled.
    assert ttft(reqs[2]) > ttft(reqs[0])
    assert reqs[2].scheduled_clock_ms is not None


async def test_admission_waits_for_memory_and_eviction_emits_removed() -> None:
    harness = Harness(kv_blocks=8)
    e = harness.engine()
    try:
        a = await finish(_submit(e, request(list(range(0, 100)), max_tokens=8)))  # 7 blocks
        b = await finish(_submit(e, request(list(range(500, 600)), max_tokens=8)))
        assert a.state is b.state is State.COMPLETED
        removed = [ev for ev in harness.events(0) if type(ev).__name__ == "BlockRemoved"]
        assert removed, "a second prompt in an 8-block cache must evict the first one's blocks"
    finally:
        for t in harness.tasks:
            t.cancel()


async def test_abort_frees_blocks(h: Harness) -> None:
    e = h.engine()
    e.stall(None)
    req = _submit(e, request(list(range(300)), max_tokens=50))
    await asyncio.sleep(0)
    e.abort(req, "client")
    assert req.state is State.ABORTED and not e.waiting
    e.unstall()
    other = await finish(_submit(e, request(list(range(300)), max_tokens=50)))
    assert other.state is State.COMPLETED
    running = await until(_submit(e, request(list(range(9000, 9300)), max_tokens=10_000, streaming=True)),
                          lambda r: len(r.output) > 0)
    assert running.state is State.RUNNING
    e.abort(running, "client")
    assert e.pool.usage() == 0.0


async def test_restart_aborts_and_forgets_cache_silently(h: Harness) -> None:
    e = h.engine()
    old_id = e.engine_id
    await finish(_submit(e, request(list(range(64)))))
    e.stall(None)
    pending = _submit(e, request(list(range(64))))
    n_batches = len(h.batches["e0"])
    e.restart()
    e.unstall()
    assert pending.state is State.ABORTED and pending.abort_reason == "restart"
    again = await finish(_submit(e, request(list(range(64)))))
    assert again.cached_tokens == 0
    assert e.engine_id != old_id
    assert not any(type(ev).__name__ == "AllBlocksCleared" for b in h.batches["e0"][n_batches:] for ev in b)


async def test_reset_goes_out_with_the_next_steps_stored_blocks(h: Harness) -> None:
    # A real vLLM publishes AllBlocksCleared at its next scheduler step, in the same batch as that step's
    # BlockStored, not when /reset_prefix_cache is called; an idle engine publishes nothing.
    e = h.engine()
    await finish(_submit(e, request(list(range(64)))))
    n_batches = len(h.batches["e0"])
    e.reset_prefix_cache()
    again = await finish(_submit(e, request(list(range(64)))))
    assert again.cached_tokens == 0
    batch = h.batches["e0"][n_batches]
    assert [type(ev).__name__ for ev in batch] == ["AllBlocksCleared", "BlockStored"]
    assert batch[1].token_ids == list(range(64))


async def test_a_prompt_of_whole_blocks_reuses_one_block_less(h: Harness) -> None:
    # vLLM always computes the last prompt token, so a prompt of exactly n blocks reuses n - 1 of them and
    # prefills the last block again (seen on a real engine: 3,008 tokens held, 2,976 reused).
    e = h.engine()
    whole = list(range(20_000, 20_000 + 3 * BS))
    await finish(_submit(e, request(whole, max_tokens=1)))
    again = await finish(_submit(e, request(list(whole), max_tokens=1)))
    assert again.cached_tokens == 2 * BS
    p = h.params
    assert ttft(again) == pytest.approx(p.step_overhead_ms + p.request_overhead_ms + p.prefill_ms_per_token * BS)
    longer = await finish(_submit(e, request(whole + [7], max_tokens=1)))
    assert longer.cached_tokens == 3 * BS


async def test_cpu_tier_hit_loads_instead_of_recomputing() -> None:
    harness = Harness(kv_blocks=130, cpu_blocks=200)
    e = harness.engine()
    try:
        doc = list(range(2000))
        first = await finish(_submit(e, request(doc, max_tokens=1)))
        await finish(_submit(e, request(list(range(5000, 7000)), max_tokens=1)))  # pushes doc to the CPU tier
        cpu_events = [ev for ev in harness.events(0) if getattr(ev, "medium", None) == "CPU"]
        assert cpu_events
        again = await finish(_submit(e, request(list(doc), max_tokens=1)))
        assert again.cached_tokens > 1000 and e.stats.cpu_loaded_tokens > 0
        assert ttft(again) < ttft(first)
    finally:
        for t in harness.tasks:
            t.cancel()


async def test_computed_blocks_reach_the_cpu_tier_while_the_request_still_runs() -> None:
    """vLLM's offloading connector stores each step's newly computed blocks, not a request's blocks as it ends: the
    prompt is on the CPU tier (and announced there) by its first token, long before its last."""
    harness = Harness(cpu_blocks=200, token_budget=4 * BS)
    e = harness.engine()
    try:
        running = _submit(e, request(list(range(16 * BS)), max_tokens=500, streaming=True))
        await until(running, lambda r: len(r.output) >= 1)
        on_cpu = {h for ev in harness.events(0) if getattr(ev, "medium", None) == "CPU" for h in ev.block_hashes}
        assert not running.finished
        assert {key.event_hash for key in running.chain} <= on_cpu
    finally:
        for t in harness.tasks:
            t.cancel()


async def test_transfer_pulls_leased_blocks(h: Harness) -> None:
    src, dst = h.engine(), h.engine()
    doc = list(range(20_000, 28_000))
    prefill = await finish(_submit(src, request(doc, max_tokens=1, prefill_only=True)))
    params = prefill.kv_transfer_params_out
    assert params is not None and params["do_remote_prefill"] and params["remote_engine_id"] == src.engine_id
    assert len(params["remote_block_ids"][0]) == len(doc) // BS
    assert src.leases
    remote = RemoteSource(params["remote_engine_id"], params["remote_request_id"])
    pulled = await finish(_submit(dst, request(list(doc), remote=remote)))
    assert pulled.transfer_status == "pulled" and pulled.transferred_tokens == (len(doc) - 1) // BS * BS
    assert pulled.cached_tokens == 0
    assert not src.leases, "a pulled lease is released"
    stored = [ev for ev in h.events(1) if type(ev).__name__ == "BlockStored"]
    assert sum(len(ev.block_hashes) for ev in stored) == len(doc) // BS
    recompute = await finish(_submit(dst, request(list(range(40_000, 48_000)))))
    assert ttft(pulled) < ttft(recompute)
    fallback = await finish(_submit(dst, request(list(range(60_000, 61_000)), remote=RemoteSource("nope", "x"))))
    assert fallback.transfer_status == "fallback" and fallback.state is State.COMPLETED


async def test_lease_expires() -> None:
    harness = Harness(transfer_lease_s=0.05)
    src = harness.engine()
    try:
        await finish(_submit(src, request(list(range(100)), max_tokens=1, prefill_only=True)))
        assert src.leases
        await wait_until_async(lambda: not src.leases, "the lease to expire", timeout=5.0)
        assert src.stats.leases_expired == 1
    finally:
        for t in harness.tasks:
            t.cancel()


def _submit(e: Engine, req: SimRequest) -> SimRequest:
    e.submit(req)
    return req


async def test_timed_stall_ends_by_itself(h: Harness) -> None:
    e = h.engine()
    stalled_at = time.monotonic()
    e.stall(0.1)
    req = await finish(_submit(e, request(list(range(40)))), timeout=2.0)
    assert not e.stalled
    assert req.first_token_wall is not None and req.first_token_wall - stalled_at >= 0.1


async def test_a_sibling_scheduled_after_reuses_blocks_still_being_computed(h: Harness) -> None:
    # vLLM caches a request's blocks when it schedules them (allocate_slots registers their hashes), so a sibling
    # scheduled after it, even in the same step, reuses them while the first one is still computing them.
    e = h.engine()
    e.stall(None)
    tokens = list(range(40_000, 42_000))
    first = _submit(e, request(tokens))
    sibling = _submit(e, request(list(tokens)))
    e.unstall()
    await finish(first)
    await finish(sibling)
    assert first.cached_tokens == 0
    assert sibling.cached_tokens == (len(tokens) - 1) // BS * BS
    assert ttft(sibling) <= ttft(first)
    stored = [ev for ev in h.events(0) if type(ev).__name__ == "BlockStored"]
    assert sum(len(ev.block_hashes) for ev in stored) == len(tokens) // BS  # announced once, by the first


async def test_reset_is_refused_while_a_request_holds_blocks(h: Harness) -> None:
    # vLLM's reset_prefix_cache fails ({"success": false}) while any block is in use, unless reset_running_requests
    # preempts the running requests first (they are computed again and report their first admission's hits).
    e = h.engine()
    tokens = list(range(50_000, 50_300))
    await finish(_submit(e, request(tokens, max_tokens=1)))
    running = _submit(e, request(list(tokens), max_tokens=2_000))
    while running.state is not State.RUNNING:
        await asyncio.sleep(0)
    assert running.cached_tokens == (len(tokens) - 1) // BS * BS
    assert e.reset_prefix_cache() is False
    assert e.pool.gpu, "a refused reset forgets nothing"
    assert e.reset_prefix_cache(reset_running_requests=True) is True
    assert running.state is State.WAITING and not running.finished
    while running.state is not State.RUNNING or running.num_computed < running.prompt_len:
        await asyncio.sleep(0)
    assert running.cached_tokens == (len(tokens) - 1) // BS * BS
    cleared = [i for i, ev in enumerate(h.events(0)) if type(ev).__name__ == "AllBlocksCleared"]
    assert len(cleared) == 1
    e.abort(running, "client")
    assert e.reset_prefix_cache() is True  # idle: nothing in use


def gaps(req: SimRequest) -> list[float]:
    clocks = req.token_clock_ms
    return [b - a for a, b in zip(clocks, clocks[1:])]


async def test_decode_step_grows_with_running_sequences_and_their_context(h: Harness) -> None:
    e = h.engine()
    p = h.params
    alone = await finish(_submit(e, request(list(range(1000)), max_tokens=3)))
    assert gaps(alone)[0] == pytest.approx(
        p.step_overhead_ms + p.decode_ms_per_seq + p.decode_ms_per_context_token * 1001)
    batch = [_submit(e, request(list(range(i * 10_000, i * 10_000 + 250)), max_tokens=3)) for i in range(32)]
    for r in batch:
        await finish(r)
    # 32 x 250 prompt tokens fit one step's budget: all 32 prefill together, then decode together.
    assert {tuple(gaps(r)) for r in batch} == {tuple(gaps(batch[0]))}
    assert gaps(batch[0])[-1] == pytest.approx(
        p.step_overhead_ms + 32 * p.decode_ms_per_seq + p.decode_ms_per_context_token * 32 * 252)
    long_context = await finish(_submit(e, request(list(range(100_000, 140_000)), max_tokens=3)))
    assert gaps(long_context)[0] - gaps(alone)[0] == pytest.approx(p.decode_ms_per_context_token * 39_000)


async def test_a_prefill_stalls_the_decodes_of_a_mixed_replica(h: Harness) -> None:
    e = h.engine()
    p = h.params
    decoding = _submit(e, request(list(range(500)), max_tokens=40, streaming=True))
    await until(decoding, lambda r: len(r.output) >= 5)
    long_prompt = _submit(e, request(list(range(50_000, 58_000)), max_tokens=1))
    await finish(decoding)
    await finish(long_prompt)
    steady = min(gaps(decoding))
    stalled = max(gaps(decoding))
    assert steady < p.step_overhead_ms + 1
    # The step that carried the 8,000-token prefill took its time, and the decode waited for all of it.
    assert stalled >= p.prefill_ms_per_token * 8000 + p.request_overhead_ms
    assert e.itl.max_ms == stalled and e.itl.count == sum(len(gaps(r)) for r in (decoding, long_prompt))


async def test_a_decode_only_replica_decodes_smoothly_while_prompts_arrive_by_transfer(h: Harness) -> None:
    prefill, decode = h.engine(), h.engine()
    p = h.params
    decoding = _submit(decode, request(list(range(500)), max_tokens=40, streaming=True))
    await until(decoding, lambda r: len(r.output) >= 5)
    first_leg = await finish(_submit(prefill, request(list(range(50_000, 58_000)), max_tokens=1, prefill_only=True)))
    params = first_leg.kv_transfer_params_out
    assert params is not None and prefill.stats.first_legs_served == 1
    pulled = _submit(decode, request(list(range(50_000, 58_000)), max_tokens=4,
                                     remote=RemoteSource(params["remote_engine_id"], params["remote_request_id"])))
    await finish(pulled)
    await finish(decoding)
    assert pulled.transfer_status == "pulled" and decode.stats.transfers_in == 1
    # Only the prompt's last tokens are computed here, with no per-request prefill overhead: the running decode's
    # steps stay within a couple of milliseconds of each other (the new sequence's 8k-token context adds ~0.2 ms).
    assert max(gaps(decoding)) - min(gaps(decoding)) < 2
    assert max(gaps(decoding)) < p.step_overhead_ms + 2
