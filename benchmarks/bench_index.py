"""Prefix-index numbers, printed (run by hand: `.venv/bin/python benchmarks/bench_index.py`).

- stored blocks decoded + applied per second on one core (vLLM-shaped batches: one BlockStored of 16 blocks per
  frame; and SGLang-shaped: one BlockStored per page);
- a full cache's churn: events decoded + applied per second when every stored block evicts one (vLLM publishes one
  BlockRemoved per evicted hash);
- lookup p50/p99 of a 40,000-token prompt (2,500 blocks of 16) over 16 replicas holding 1,000,000 blocks in total;
- bytes per (block, replica) holding, measured with tracemalloc (index alone, and with the ingestor's engine-hash map);
- block_keys time for 40,000 tokens;
- a prompt's keys through RecentBlockKeys (the route stage's) against block_keys, per prompt size: a prompt that
  shares all but its last 40 tokens with the previous one (a chat's next turn, a document asked about again), and one
  that shares nothing (the cost of remembering it),
  with the reuse floor lowered to 1 block to show where it pays;
- a live subscription's CPU per frame: frames published one at a time over real ZMQ by another process (as an engine
  publishes one batch per step), received, decoded and applied by a KvEventSubscriber on uvloop, against the same
  frames decoded and applied without a socket: the difference is what receiving costs per wake-up.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array

import msgspec

from kvgate.cache_index.index import _SWEEP_AFTER, PrefixIndex
from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.keys import RecentBlockKeys, block_keys, namespace_key
from kvgate.cache_index.match import Tier
from kvgate.cache_index.subscriber import KvEventSubscriber
from kvgate.loadgen.sim.wire import BlockRemoved, BlockStored, KVEventBatch

BS = 16
REPLICAS = 16
TOTAL_BLOCKS = 1_000_000
PROMPT_TOKENS = 40_000


def event_frames(n_frames: int, blocks_per_event: int, events_per_frame: int, request_blocks: int = 64) -> list[bytes]:
    """Requests of ``request_blocks`` chained blocks, published ``blocks_per_event`` blocks per BlockStored (each
    event's parent is the previous event's last block), ``events_per_frame`` events per frame."""
    rng = random.Random(1)
    frames = []
    engine_hash = 1
    parent: int | None = None
    in_request = 0
    for _ in range(n_frames):
        events = []
        for _ in range(events_per_frame):
            if in_request >= request_blocks:
                parent, in_request = None, 0
            hashes = list(range(engine_hash, engine_hash + blocks_per_event))
            engine_hash += blocks_per_event
            tokens = [rng.randrange(32000) for _ in range(blocks_per_event * BS)]
            events.append(BlockStored(hashes, parent, tokens, BS, None, "GPU", None))
            parent = hashes[-1]
            in_request += blocks_per_event
        frames.append(msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return frames


def ingest_timed(frames: list[bytes]) -> tuple[PrefixIndex, EventIngestor, float]:
    """``frames`` applied in order as one replica's stream to a fresh index; the CPU seconds that took."""
    index = PrefixIndex(max_entries=10_000_000)
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    start = time.process_time()
    for seq, payload in enumerate(frames):
        ingestor.apply("r", seq, payload)
    return index, ingestor, time.process_time() - start


def bench_ingest(label: str, frames: list[bytes], blocks: int) -> None:
    index, _, elapsed = ingest_timed(frames)
    assert index.stats().entries == blocks, index.stats()
    print(f"ingest {label}: {blocks / elapsed:,.0f} stored blocks/s decoded+applied (one core, {blocks:,} blocks)")


def churn_frames(n_frames: int, capacity_blocks: int) -> list[bytes]:
    """A full cache's steady state, as vLLM publishes it: per frame, one request's BlockStored of 16 new blocks and a
    BlockRemoved of one hash for each of the 16 oldest blocks it evicted, once ``capacity_blocks`` are held."""
    rng = random.Random(5)
    frames = []
    held: list[int] = []
    engine_hash = 1
    for _ in range(n_frames):
        hashes = list(range(engine_hash, engine_hash + 16))
        engine_hash += 16
        tokens = [rng.randrange(32000) for _ in range(16 * BS)]
        events: list[BlockStored | BlockRemoved] = []
        while len(held) + len(hashes) > capacity_blocks:
            events.append(BlockRemoved([held.pop(0)], "GPU"))
        events.append(BlockStored(hashes, None, tokens, BS, None, "GPU", None))
        held.extend(hashes)
        frames.append(msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return frames


def bench_churn(capacity_blocks: int = 3_000) -> None:
    frames = churn_frames(20_000, capacity_blocks)
    index, ingestor, elapsed = ingest_timed(frames)
    assert index.stats().entries == capacity_blocks, index.stats()
    events = ingestor.stats.events_applied
    print(f"ingest churn (a full cache of {capacity_blocks:,} blocks; per frame 16 stored, 16 removed one by one): "
          f"{events / elapsed:,.0f} events/s, {len(frames) * 32 / elapsed:,.0f} blocks stored or removed/s")


def populated_index() -> tuple[PrefixIndex, list[int]]:
    rng = random.Random(2)
    index = PrefixIndex(max_entries=10_000_000)
    prompt = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
    prompt_keys = block_keys(namespace_key("m"), prompt, BS)
    per_replica = TOTAL_BLOCKS // REPLICAS
    for r in range(REPLICAS):
        name = f"replica-{r}"
        shared = prompt_keys[: (r + 1) * len(prompt_keys) // REPLICAS]  # replica r holds a prefix of the prompt
        index.store(name, shared, Tier.GPU if r % 3 else Tier.CPU, 0)
        own = [rng.getrandbits(64) for _ in range(per_replica - len(shared))]
        for i in range(0, len(own), 256):
            index.store(name, own[i : i + 256], Tier.GPU, 0)
    return index, prompt_keys


def bench_lookup() -> None:
    index, prompt_keys = populated_index()
    print(f"index: {index.stats().entries:,} holdings over {REPLICAS} replicas")
    wall, cpu = [], []
    for _ in range(1000):
        start, start_cpu = time.perf_counter(), time.thread_time()
        index.lookup(prompt_keys, BS)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    wall.sort()
    cpu.sort()
    matches = index.lookup(prompt_keys, BS)
    print(f"lookup 40,000-token prompt ({len(matches)} replicas matched): CPU p50 {statistics.median(cpu):.3f} ms, "
          f"p99 {cpu[989]:.3f} ms; wall p50 {statistics.median(wall):.3f} ms, p99 {wall[989]:.3f} ms "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    start = time.perf_counter()
    dropped = index.drop_replica("replica-7")
    dropped_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    index.sweep()
    print(f"drop_replica ({dropped:,} holdings): {dropped_ms:.2f} ms; the deferred sweep (once per "
          f"{_SWEEP_AFTER} drops): {(time.perf_counter() - start) * 1e3:.0f} ms")


def bench_memory() -> None:
    rng = random.Random(3)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keys = [rng.getrandbits(64) | 1 << 63 for _ in range(TOTAL_BLOCKS)]  # full-width keys, as block_keys makes
    keys_list_bytes = sys.getsizeof(keys)
    index = PrefixIndex(max_entries=10_000_000)
    per_replica = TOTAL_BLOCKS // REPLICAS
    for r in range(REPLICAS):
        chunk = keys[r * per_replica : (r + 1) * per_replica]
        for i in range(0, len(chunk), 256):
            index.store(f"replica-{r}", chunk[i : i + 256], Tier.GPU, 0)
    used = tracemalloc.get_traced_memory()[0] - base - keys_list_bytes
    tracemalloc.stop()
    entries = index.stats().entries
    print(f"memory: {used / entries:.0f} bytes per holding in the index, every block on one replica only "
          f"({used / 2**20:.0f} MiB for {entries:,} holdings; "
          f"stats() estimates {index.stats().approx_bytes / 2**20:.0f} MiB)")

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(max_entries=10_000_000)
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    frames = event_frames(2_000, 16, 4)
    frames_bytes = tracemalloc.get_traced_memory()[0] - base
    for seq, payload in enumerate(frames):
        ingestor.apply("r", seq, payload)
    used = tracemalloc.get_traced_memory()[0] - base - frames_bytes
    tracemalloc.stop()
    entries = index.stats().entries
    print(f"memory via events: {used / entries:.0f} bytes per holding including the engine-hash map "
          f"({entries:,} holdings)")


def bench_block_keys() -> None:
    rng = random.Random(4)
    tokens = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
    ns = namespace_key("m")
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        block_keys(ns, tokens, BS)
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    print(f"block_keys 40,000 tokens: p50 {statistics.median(samples):.3f} ms, min {samples[0]:.3f} ms")


def bench_recent_keys() -> None:
    rng = random.Random(5)
    ns = namespace_key("m")
    rounds = 300
    for blocks in (32, 64, 128, 256, 1024, 4096):
        base = array("I", [rng.randrange(32000) for _ in range(blocks * BS)])
        # the same prompt with a new last turn of 40 tokens each time (the overhead benchmark's shape)
        turns = [base + array("I", [rng.randrange(32000) for _ in range(40)]) for _ in range(rounds + 1)]
        unique = [array("I", [rng.randrange(32000) for _ in range(blocks * BS)]) for _ in range(rounds)]
        timed: dict[str, float] = {}
        for label, prompts in (("extending", turns[1:]), ("unique", unique)):
            recent = RecentBlockKeys(min_blocks=1)
            recent.keys(ns, turns[0], BS, "s")
            start = time.perf_counter()
            for prompt in prompts:
                block_keys(ns, prompt, BS)
            timed[f"{label} block_keys"] = (time.perf_counter() - start) / rounds * 1e6
            start = time.perf_counter()
            for prompt in prompts:
                recent.keys(ns, prompt, BS, "s")
            timed[f"{label} recent"] = (time.perf_counter() - start) / rounds * 1e6
        print(f"keys of a {blocks * BS:,}-token prompt (us): a new last turn {timed['extending block_keys']:.1f}"
              f" hashed whole, {timed['extending recent']:.1f} with RecentBlockKeys; unique "
              f"{timed['unique block_keys']:.1f} and {timed['unique recent']:.1f}")


LIVE_FRAMES = 4_000
LIVE_INTERVAL_S = 0.0005
PUBLISHER = """
import sys, time, msgspec, zmq
frames = msgspec.msgpack.decode(open(sys.argv[2], "rb").read())
pub = zmq.Context().socket(zmq.PUB)
pub.bind(sys.argv[1])
sys.stdout.write("bound\\n"); sys.stdout.flush()
sys.stdin.readline()  # the subscriber has joined
for seq, payload in enumerate(frames):
    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
    time.sleep(float(sys.argv[3]))
time.sleep(600)  # until stopped: the subscriber reads what is queued
"""


def bench_live_subscription() -> None:
    """CPU per frame of a live subscription on uvloop, frames arriving one per wake-up."""
    import uvloop

    frames = event_frames(LIVE_FRAMES, 1, 1)
    _, _, applied_s = ingest_timed(frames)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    handle, path = tempfile.mkstemp(prefix="kvgate-bench-frames-")
    with os.fdopen(handle, "wb") as out:
        out.write(msgspec.msgpack.encode(frames))
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, f"tcp://127.0.0.1:{port}", path, str(LIVE_INTERVAL_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert publisher.stdout is not None and publisher.stdin is not None
        publisher.stdout.readline()

        async def receive() -> float:
            index = PrefixIndex(max_entries=10_000_000)
            ingestor = EventIngestor(index)
            ingestor.add_replica("r", model="m")
            subscriber = KvEventSubscriber(ingestor, "r", f"tcp://127.0.0.1:{port}", topic="kv")
            subscriber.start()
            await asyncio.sleep(0.5)  # the SUB socket joins; nothing is published before the go below
            publisher.stdin.write("go\n")
            publisher.stdin.flush()
            start = time.process_time()
            deadline = time.monotonic() + 60
            while ingestor.expected_seq("r") != LIVE_FRAMES and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            elapsed = time.process_time() - start
            await subscriber.stop()
            assert ingestor.expected_seq("r") == LIVE_FRAMES, ingestor.expected_seq("r")
            return elapsed

        live_s = uvloop.run(receive())
    finally:
        publisher.kill()
        publisher.wait(timeout=30)
        os.unlink(path)
    print(f"live subscription: {live_s / LIVE_FRAMES * 1e6:.1f} µs CPU per frame received one per wake-up "
          f"({applied_s / LIVE_FRAMES * 1e6:.1f} µs of it decoding and applying; {LIVE_FRAMES:,} frames of 1 block, "
          f"one every {LIVE_INTERVAL_S * 1e3:g} ms, the loop's 50 ms checks included)")


def main() -> None:
    bench_block_keys()
    bench_recent_keys()
    bench_ingest("vLLM-shaped (16 blocks per BlockStored, 4 per frame)", event_frames(5_000, 16, 4), 5_000 * 64)
    bench_ingest("SGLang-shaped (1 block per BlockStored, 16 per frame)", event_frames(10_000, 1, 16), 10_000 * 16)
    bench_churn()
    bench_live_subscription()
    bench_lookup()
    bench_memory()


if __name__ == "__main__":
    main()
