"""``kvgate sim``: run N simulated vLLM replicas in one process until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import zmq

from loadgen.assets import DEFAULT_MODEL, TOKENIZER_DIR

from .fleet import Fleet
from .model import SimModel
from .params import SimParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimParams(model=DEFAULT_MODEL)
    a = parser.add_argument
    a("--replicas", type=int, default=4, help="number of replicas (default 4)")
    a("--host", default="127.0.0.1", help="address every socket binds (default 127.0.0.1)")
    a("--port", type=int, default=9000, help="HTTP port of replica 0; replica i uses port+i (default 9000)")
    a("--zmq-port", type=int, default=5557,
      help="KV-event PUB port of replica 0; replica i publishes on zmq-port+2i, replays on zmq-port+2i+1")
    a("--time-scale", type=float, default=d.time_scale,
      help="multiplies every simulated duration; 0.01 makes 1 s take 10 ms, 0 is instant (default 1.0)")
    a("--kv-blocks", type=int, default=d.kv_blocks, help=f"GPU KV blocks per replica (default {d.kv_blocks})")
    a("--cpu-blocks", type=int, default=d.cpu_blocks, help="CPU-tier blocks per replica; 0 disables (default 0)")
    a("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    a("--max-model-len", type=int, default=0,
      help="longest prompt+completion; default: what the KV cache holds (kv-blocks x block-size)")
    a("--model", default=DEFAULT_MODEL, help=f"served model name (default {DEFAULT_MODEL})")
    a("--tokenizer", default=str(TOKENIZER_DIR), help="HF model directory or tokenizer.json (default: shipped one)")
    a("--write-config", type=Path, default=None, help="write a kvgate policy file listing this fleet")
    a("--step-overhead-ms", type=float, default=d.step_overhead_ms,
      help=f"fixed cost of every scheduler step (default {d.step_overhead_ms})")
    a("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
      help=f"prefill cost per computed token (default {d.prefill_ms_per_token})")
    a("--request-overhead-ms", type=float, default=d.request_overhead_ms,
      help=f"fixed prefill cost per request (default {d.request_overhead_ms})")
    a("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq,
      help=f"step cost per decoding sequence (default {d.decode_ms_per_seq})")
    a("--token-budget", type=int, default=d.token_budget,
      help=f"tokens scheduled per step; longer prefills are chunked (default {d.token_budget})")
    a("--max-num-seqs", type=int, default=d.max_num_seqs,
      help=f"most requests running at once per replica (default {d.max_num_seqs})")
    a("--cpu-load-gib-s", type=float, default=d.cpu_load_gib_s,
      help=f"host-to-GPU bandwidth for CPU-tier hits, 320 KiB/token (default {d.cpu_load_gib_s})")
    a("--transfer-lease-s", type=float, default=d.transfer_lease_s,
      help=f"wall-clock seconds prefill-only blocks stay held for a remote decode (default {d.transfer_lease_s})")
    a("--replay-buffer-steps", type=int, default=d.replay_buffer_steps,
      help=f"event batches kept for replay (default {d.replay_buffer_steps})")
    a("--topic", default=d.topic, help="KV-event topic (first frame of every message; default empty)")
    a("--seed", type=int, default=d.seed, help="seed of generated text and dropped-frame choices (default 0)")


def params_from_args(args: argparse.Namespace) -> SimParams:
    capacity = args.kv_blocks * args.block_size
    if args.max_model_len > capacity:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the KV cache ({capacity} tokens)")
    return SimParams(
        model=args.model, block_size=args.block_size, kv_blocks=args.kv_blocks, cpu_blocks=args.cpu_blocks,
        max_model_len=args.max_model_len or capacity, time_scale=args.time_scale,
        step_overhead_ms=args.step_overhead_ms, prefill_ms_per_token=args.prefill_ms_per_token,
        request_overhead_ms=args.request_overhead_ms, decode_ms_per_seq=args.decode_ms_per_seq,
        token_budget=args.token_budget, max_num_seqs=args.max_num_seqs, cpu_load_gib_s=args.cpu_load_gib_s,
        transfer_lease_s=args.transfer_lease_s, replay_buffer_steps=args.replay_buffer_steps, topic=args.topic,
        seed=args.seed,
    )


def _validate(args: argparse.Namespace) -> str | None:
    checks = [
        (args.replicas >= 1, "--replicas must be at least 1"),
        (args.kv_blocks >= 1 and args.block_size >= 1, "--kv-blocks and --block-size must be positive"),
        (args.cpu_blocks >= 0, "--cpu-blocks must be >= 0"),
        (args.time_scale >= 0, "--time-scale must be >= 0"),
        (args.token_budget >= 1 and args.max_num_seqs >= 1, "--token-budget and --max-num-seqs must be positive"),
        (args.replay_buffer_steps >= 1, "--replay-buffer-steps must be positive"),
        (args.cpu_load_gib_s > 0, "--cpu-load-gib-s must be positive"),
        (min(args.step_overhead_ms, args.prefill_ms_per_token, args.request_overhead_ms,
             args.decode_ms_per_seq, args.transfer_lease_s) >= 0, "durations must be >= 0"),
    ]
    return next((msg for ok, msg in checks if not ok), None)


async def serve(args: argparse.Namespace) -> None:
    params = params_from_args(args)
    model = SimModel.load(args.model, args.tokenizer)
    fleet = Fleet(args.replicas, args.host, args.port, args.zmq_port, params, model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start()
        if args.write_config is not None:
            fleet.write_policy_file(args.write_config)
        for r in fleet:
            print(f"{r.name}: {r.url}  events {r.pub_endpoint}  replay {r.replay_endpoint}  "
                  f"model {params.model}  kv_blocks {params.kv_blocks}x{params.block_size}", flush=True)
        if args.write_config is not None:
            print(f"wrote {args.write_config}", flush=True)
        await stop.wait()
    finally:
        await fleet.close()


def run(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem is not None:
        print(f"kvgate sim: {problem}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(args))
    except (OSError, zmq.ZMQError, ValueError) as e:  # a port in use, a bad tokenizer path, ...
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 1
    return 0
