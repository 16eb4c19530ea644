"""``kvgate sim``: run N simulated vLLM replicas in one process until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import zmq

from kvgate.loadgen.assets import DEFAULT_MODEL, TOKENIZER_DIR

from .fleet import SimFleet
from .model import SimModel
from .params import SimParams
from .responses import store_enabled


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimParams(model=DEFAULT_MODEL)
    a = parser.add_argument
    a("--replicas", type=int, default=None, help="number of replicas (default 4, or the sum of --roles)")
    a("--roles", type=parse_roles, default=None, metavar="ROLE:N,...",
      help="prefill/decode roles, e.g. prefill:2,decode:6 (replicas in that order; roles prefill, decode, both): "
           "written into the --write-config policy file; counts must add up to --replicas when both are given")
    a("--host", default="127.0.0.1", help="address every socket binds (default 127.0.0.1)")
    a("--port", type=int, default=9000, help="HTTP port of replica 0; replica i uses port+i (default 9000)")
    a("--zmq-port", type=int, default=5557,
      help="KV-event PUB port of replica 0; replica i publishes on zmq-port+2i, replays on zmq-port+2i+1")
    a("--time-scale", type=float, default=d.time_scale,
      help="multiplies every simulated duration; 0.01 makes 1 s take 10 ms, 0 is instant (default 1.0)")
    a("--kv-blocks", type=int, default=d.kv_blocks, help=f"GPU KV blocks per replica (default {d.kv_blocks})")
    a("--cpu-blocks", type=int, default=d.cpu_blocks, help="CPU-tier blocks per replica; 0 disables (default 0)")
    a("--block-size", type=int, default=None,
      help=f"tokens per KV block (default {d.block_size}, or the first multiple of --block-size-multiple-of above it)")
    a("--block-size-multiple-of", type=int, default=1, metavar="N",
      help="block sizes the simulated attention backend runs: multiples of N (vLLM's CPU backend: 32); another "
           "--block-size is refused at startup, as vLLM refuses it (default 1: any)")
    a("--max-model-len", type=int, default=0,
      help="longest prompt+completion; default: what the KV cache holds (kv-blocks x block-size)")
    a("--model", default=DEFAULT_MODEL, help=f"served model name (default {DEFAULT_MODEL})")
    a("--tokenizer", default=str(TOKENIZER_DIR), help="HF model directory or tokenizer.json (default: shipped one)")
    a("--bootstrap-port", type=int, default=None, metavar="PORT",
      help="speak SGLang's P/D handoff: replica i runs a bootstrap server on PORT+i when it is a prefill replica "
           "(every replica without --roles), and the written config lists the fleet as sglang replicas, prefill "
           "ones with their bootstrap_port (default: none)")
    a("--write-config", type=Path, default=None, help="write a kvgate policy file listing this fleet")
    a("--step-overhead-ms", type=float, default=d.step_overhead_ms,
      help=f"fixed cost of every scheduler step (default {d.step_overhead_ms})")
    a("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
      help=f"prefill cost per computed token (default {d.prefill_ms_per_token})")
    a("--request-overhead-ms", type=float, default=d.request_overhead_ms,
      help=f"fixed prefill cost per request (default {d.request_overhead_ms})")
    a("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq,
      help=f"step cost per decoding sequence (default {d.decode_ms_per_seq})")
    a("--decode-ms-per-context-token", type=float, default=d.decode_ms_per_context_token,
      help="step cost per token of KV a decoding sequence attends over (default "
           f"{d.decode_ms_per_context_token})")
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


ROLES = ("prefill", "decode", "both")
DEFAULT_REPLICAS = 4


def parse_roles(text: str) -> list[str]:
    """``prefill:2,decode:6`` → each replica's role, in order."""
    roles: list[str] = []
    for part in text.split(","):
        role, sep, count = part.strip().partition(":")
        if role not in ROLES or not sep or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected ROLE:N,... with ROLE one of {', '.join(ROLES)}, got {text!r}")
        roles += [role] * int(count)
    return roles


def replica_count(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return args.replicas
    return len(args.roles) if args.roles else DEFAULT_REPLICAS


def block_size(args: argparse.Namespace) -> int:
    """``--block-size``, or without it the default rounded up to the backend's multiple (vLLM picks a size the
    attention backend supports when none is given)."""
    if args.block_size is not None:
        return args.block_size
    multiple = max(1, args.block_size_multiple_of)
    return -(-SimParams(model="").block_size // multiple) * multiple


def params_from_args(args: argparse.Namespace) -> SimParams:
    bs = block_size(args)
    capacity = args.kv_blocks * bs
    if args.max_model_len > capacity:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the KV cache ({capacity} tokens)")
    return SimParams(
        model=args.model, block_size=bs, kv_blocks=args.kv_blocks, cpu_blocks=args.cpu_blocks,
        max_model_len=args.max_model_len or capacity, time_scale=args.time_scale,
        step_overhead_ms=args.step_overhead_ms, prefill_ms_per_token=args.prefill_ms_per_token,
        request_overhead_ms=args.request_overhead_ms, decode_ms_per_seq=args.decode_ms_per_seq,
        decode_ms_per_context_token=args.decode_ms_per_context_token,
        token_budget=args.token_budget, max_num_seqs=args.max_num_seqs, cpu_load_gib_s=args.cpu_load_gib_s,
        transfer_lease_s=args.transfer_lease_s, replay_buffer_steps=args.replay_buffer_steps, topic=args.topic,
        seed=args.seed, responses_store=store_enabled(os.environ),
    )


def _validate(args: argparse.Namespace) -> str | None:
    checks = [
        (replica_count(args) >= 1, "--replicas must be at least 1"),
        (args.roles is None or len(args.roles) == replica_count(args),
         f"--roles adds up to {len(args.roles or [])} replicas, --replicas says {args.replicas}"),
        (args.kv_blocks >= 1 and (args.block_size is None or args.block_size >= 1),
         "--kv-blocks and --block-size must be positive"),
        (args.block_size_multiple_of >= 1, "--block-size-multiple-of must be positive"),
        (args.block_size is None or args.block_size_multiple_of < 1
         or args.block_size % args.block_size_multiple_of == 0,
         f"No common block size for {args.block_size} (SIM_ATTN: [MultipleOf({args.block_size_multiple_of})])"),
        (args.cpu_blocks >= 0, "--cpu-blocks must be >= 0"),
        (args.bootstrap_port is None or 0 < args.bootstrap_port <= 65535 - replica_count(args),
         "--bootstrap-port must leave room for one port per replica"),
        (args.time_scale >= 0, "--time-scale must be >= 0"),
        (args.token_budget >= 1 and args.max_num_seqs >= 1, "--token-budget and --max-num-seqs must be positive"),
        (args.replay_buffer_steps >= 1, "--replay-buffer-steps must be positive"),
        (args.cpu_load_gib_s > 0, "--cpu-load-gib-s must be positive"),
        (min(args.step_overhead_ms, args.prefill_ms_per_token, args.request_overhead_ms,
             args.decode_ms_per_seq, args.decode_ms_per_context_token, args.transfer_lease_s) >= 0, "durations must be >= 0"),
    ]
    return next((msg for ok, msg in checks if not ok), None)


async def serve(args: argparse.Namespace) -> None:
    params = params_from_args(args)
    model = SimModel.load(args.model, args.tokenizer)
    fleet = SimFleet(replica_count(args), args.host, args.port, args.zmq_port, params, model, args.roles,
                     args.bootstrap_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start()
        if args.write_config is not None:
            fleet.write_policy_file(args.write_config)
        for r in (server.replica for server in fleet):
            print(f"{r.name}: {r.url}  role {r.role}  events {r.pub_endpoint}  replay {r.replay_endpoint}  "
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
