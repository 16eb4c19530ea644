"""KV movement in a real sim process: eviction under a small cache (BlockRemoved), the CPU tier, and NIXL-style
transfers between replicas (prefill-only on one, pull on the other, BlockStored on the destination)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import httpx
import msgspec
import pytest
import zmq

from kvgate.loadgen.sim.block_hash import block_chain
from kvgate.loadgen.sim.wire import BlockRemoved, BlockStored, KVEventBatch
from tests.support import PROBE_TOKENS, Sim, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
DEADLINE_S = 5.0


def doc(words: int) -> str:
    return f"{uuid.uuid4()} " + " ".join(f"w{i} shared context" for i in range(words))


def complete(sim: Sim, replica: int, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(sim.url(replica) + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body},
                   headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def record(sim: Sim, replica: int, request_id: str) -> dict[str, Any]:
    entries = httpx.get(sim.url(replica) + "/sim/requests", params={"limit": 100}, timeout=2).json()["requests"]
    return next(e for e in reversed(entries) if e["headers"]["x-request-id"] == request_id)


def tokens(sim: Sim, prompt: str) -> list[int]:
    return httpx.post(sim.url(0) + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=5).json()["tokens"]


def collect(sim: Sim, replica: int, action: Any, until: Any) -> list[Any]:
    """Run ``action`` with a live SUB on the replica; return its events up to the first satisfying ``until``."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sim.events_endpoint(replica))
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not sub.poll(100):  # wait until subscribed: a reset and a step publish an AllBlocksCleared batch
            assert time.monotonic() < deadline, "subscriber never joined"
            sim.reset_and_step(replica)
        while sub.poll(100):
            sub.recv_multipart()
        action()
        events: list[Any] = []
        while time.monotonic() < deadline:
            if not sub.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            batch = msgspec.msgpack.decode(sub.recv_multipart()[2], type=KVEventBatch)
            events.extend(batch.events)
            if until(events):
                return events
        raise AssertionError(f"condition not met; events: {events}")
    finally:
        sub.close(0)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    # The CPU tier holds a copy of what the GPU does (written as each request computes it), so it is the larger one.
    s = start_sim(tmp_path_factory.mktemp("sim-small"), 1, "--time-scale", "0.01", "--kv-blocks", "16",
                  "--cpu-blocks", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim-pair"), 2, "--time-scale", "0.01")
    yield s
    s.stop()


def test_small_cache_evicts_from_the_gpu_and_loads_back_from_the_cpu_tier(small: Sim) -> None:
    first, second = doc(20), doc(20)  # ~160 tokens = 10 blocks each; two of them do not fit in 16 blocks
    third = doc(20)

    def run() -> None:
        for prompt in (first, second, third):
            complete(small, 0, {"prompt": prompt})

    probe = {k.event_hash for k in block_chain(PROBE_TOKENS, 16)}  # collect's own block, older than the prompts

    def not_probe(e: BlockStored | BlockRemoved) -> bool:
        return e.block_hashes[0] not in probe

    events = collect(small, 0, run, lambda evs: sum(isinstance(e, BlockRemoved) and not_probe(e) for e in evs) >= 1)
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    removed = [e for e in removed if not_probe(e)]
    first_hashes = {k.event_hash for k in block_chain(tokens(small, first), 16)}
    assert removed[0].block_hashes[0] in first_hashes, "the least recently used prompt goes first"
    # Each request's blocks were written to the CPU tier as they were computed, so what the GPU evicts is still there.
    cpu = {h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes}
    assert first_hashes <= cpu and removed[0].block_hashes[0] in cpu
    rid = uuid.uuid4().hex
    again = complete(small, 0, {"prompt": first}, rid)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "CPU-tier hits count as cached"
    assert record(small, 0, rid)["load_ms"] > 0, "loaded back from the CPU tier"
    usage = httpx.get(small.url(0) + "/metrics").text
    assert 'num_gpu_blocks="16"' in usage


def test_transfer_moves_blocks_and_beats_recompute(pair: Sim) -> None:
    prompt = doc(600)  # ~3,000 tokens
    first_leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    prefill = complete(pair, 0, {"prompt": prompt, "kv_transfer_params": first_leg, "max_tokens": 1}, "p-leg")
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == pair.http_port
    assert params["tp_size"] == 1 and params["remote_num_tokens"] == prefill["usage"]["prompt_tokens"]
    assert isinstance(params["remote_engine_id"], str) and isinstance(params["remote_request_id"], str)
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) >= 180
    assert prefill["usage"]["completion_tokens"] == 1

    expected = [k.event_hash for k in block_chain(tokens(pair, prompt), 16)]
    events = collect(pair, 1, lambda: complete(pair, 1, {"prompt": prompt, "kv_transfer_params": params}, "d-leg"),
                     lambda evs: sum(len(e.block_hashes) for e in evs if isinstance(e, BlockStored)) >= len(expected))
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == expected, "the destination announces the pulled blocks, then the ones it computed"
    pulled = record(pair, 1, "d-leg")
    assert pulled["transfer_status"] == "pulled" and pulled["transferred_tokens"] >= 2900
    assert pulled["cached_tokens"] == 0, "transferred tokens are external hits, not prefix-cache hits"

    complete(pair, 1, {"prompt": doc(600)}, "recompute")
    recompute = record(pair, 1, "recompute")
    assert pulled["ttft_ms"] < recompute["ttft_ms"]
    metrics = httpx.get(pair.url(1) + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:external_prefix_cache_hits_total"))
    assert float(line.rsplit(" ", 1)[1]) >= pulled["transferred_tokens"]

    stale = complete(pair, 1, {"prompt": doc(50), "kv_transfer_params": params}, "stale-lease")
    assert stale["usage"]["completion_tokens"] == 2
    assert record(pair, 1, "stale-lease")["transfer_status"] == "fallback"
