"""The replica scheduler on its model clock (time_scale 0, no sockets): TTFT = queue wait + prefill of uncached
tokens, chunked prefill, memory-bound admission, aborts, restarts, CPU-tier loads and NIXL-style transfers."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from loadgen.sim.block_hash import block_chain
from loadgen.sim.engine import Engine, RemoteSource, SimRequest, State
from loadgen.sim.params import SimParams

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


async def finish(req: SimRequest, timeout: float = 5.0) -> SimRequest:
    async def wait() -> None:
        while not req.finished:
            req.changed.clear()
            await req.changed.wait()
    await asyncio.wait_for(wait(), timeout)
    return req


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
    running = _submit(e, request(list(range(9000, 9300)), max_tokens=10_000))
    while running.state is not State.RUNNING:
        await asyncio.sleep(0)
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
        for _ in range(100):
            if not src.leases:
                break
            await asyncio.sleep(0.01)
        assert not src.leases and src.stats.leases_expired == 1
    finally:
        for t in harness.tasks:
            t.cancel()


def _submit(e: Engine, req: SimRequest) -> SimRequest:
    e.submit(req)
    return req


async def test_timed_stall_ends_by_itself(h: Harness) -> None:
    e = h.engine()
    e.stall(0.1)
    req = _submit(e, request(list(range(40))))
    await asyncio.sleep(0.05)
    assert req.state is State.WAITING and e.stalled
    await finish(req, timeout=2.0)
    assert not e.stalled
