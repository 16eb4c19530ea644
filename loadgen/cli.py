"""``kvgate loadgen``: drive any OpenAI-compatible endpoint (kvgate, a peer router, one engine) with a workload and
report latency, throughput and cache hits. The workload options here are shared with ``kvgate bench``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rich.console import Console

from kvgate.loadgen.apis import APIS
from kvgate.loadgen.assets import DEFAULT_MODEL, TOKENIZER_DIR
from kvgate.loadgen.plots import write_plots
from kvgate.loadgen.report import print_table, schedule_warning, summarize, write_results
from kvgate.loadgen.runner import RequestRecord, RunConfig, run_workload
from kvgate.loadgen.workloads import WORKLOADS, build_workload
from kvgate.loadgen.workloads.request import Request, WorkloadOptions, working_set_tokens
from kvgate.loadgen.workloads.trace import TraceError


def _pair(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected A:B, got {text!r}") from e
    if b <= a:
        raise argparse.ArgumentTypeError(f"expected A < B, got {text!r}")
    return a, b


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", required=True, choices=WORKLOADS)
    w.add_argument("--seed", type=int, default=0, help="same seed → identical requests (default 0)")
    w.add_argument("--requests", type=int, help="at most this many requests (trace: the first N of the window; unique, documents: exactly N, default 200)")
    w.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (multi-turn: sessions/s); 0 = all at once")
    w.add_argument("--output-tokens", type=int, default=64, help="max_tokens of synthetic requests (default 64)")
    w.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR, help="tokenizer directory (default: the shipped one)")
    w.add_argument("--groups", type=int, default=8, help="shared-prefix: groups (default 8)")
    w.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix: prompts per group (default 16)")
    w.add_argument("--system-tokens", type=int, default=2048, help="shared-prefix, agentic: system prompt tokens (default 2048)")
    w.add_argument("--question-tokens", type=int, default=128, help="shared-prefix/documents: question tokens (default 128)")
    w.add_argument("--sessions", type=int, default=16, help="multi-turn, agentic: sessions (default 16)")
    w.add_argument("--turns", type=int, default=5, help="multi-turn, agentic: turns per session (default 5)")
    w.add_argument("--turn-tokens", type=int, default=256, help="multi-turn: user message tokens (default 256)")
    w.add_argument("--think-time", type=float, default=1.0, help="multi-turn, agentic: mean seconds between turns (default 1)")
    w.add_argument("--context-tokens", type=int, default=100_000,
                   help="agentic: context tokens a session grows toward (default 100000; scale down to run here)")
    w.add_argument("--subagent-prob", type=float, default=0.25,
                   help="agentic: probability of a sub-agent side chain after a turn (default 0.25)")
    w.add_argument("--idle-time", type=float, default=30.0,
                   help="agentic: mean of the occasional user idle gap between turns, seconds (default 30)")
    w.add_argument("--documents", type=int, default=16, help="documents: corpus size (default 16)")
    w.add_argument("--document-tokens", type=_pair, default=(10_000, 40_000), help="documents: length range A:B tokens")
    w.add_argument("--zipf", type=float, default=1.1, help="documents: Zipf exponent of popularity (default 1.1)")
    w.add_argument("--prompt-tokens", type=int, default=1024, help="unique: prompt tokens (default 1024)")
    w.add_argument("--long-fraction", type=float, default=0.25,
                   help="pd-mix: share of long requests (default 0.25)")
    w.add_argument("--long-tokens", type=_pair, default=(4_000, 16_000),
                   help="pd-mix: long prompt length range A:B tokens (default 4000:16000)")
    w.add_argument("--long-output-tokens", type=_pair, default=(256, 1_024),
                   help="pd-mix: long requests' output range A:B tokens (default 256:1024)")
    w.add_argument("--chat-tokens", type=_pair, default=(64, 512),
                   help="pd-mix: chat user message range A:B tokens, after a 256-token system prompt (default 64:512)")
    w.add_argument("--chat-output-tokens", type=_pair, default=(16, 256),
                   help="pd-mix: chat output range A:B tokens (default 16:256)")
    w.add_argument("--trace", type=Path, help="trace: a Mooncake .jsonl or Azure LLM inference .csv file")
    w.add_argument("--speed", type=float, default=1.0,
                   help="trace, pd-mix: replay speed factor (2 = twice as fast; kvgate bench: 1/time-scale)")
    w.add_argument("--window", type=_pair, help="trace: window A:B in seconds of trace time")
    w.add_argument("--max-output-tokens", type=int, help="trace: cap on output lengths")
    w.add_argument("--max-input-tokens", type=int, help="trace: skip requests with longer prompts")
    r = parser.add_argument_group("run")
    r.add_argument("--model", default=DEFAULT_MODEL, help=f"model name sent in requests (default {DEFAULT_MODEL})")
    r.add_argument("--api", choices=APIS, default="chat",
                   help="the API chat requests go through: chat (/v1/chat/completions), messages (Anthropic's "
                        "/v1/messages, as Claude Code sends it) or responses (OpenAI's /v1/responses); completion "
                        "requests always use /v1/completions (default chat)")
    r.add_argument("--concurrency", type=int, default=256, help="cap on requests in flight (default 256)")
    r.add_argument("--duration", type=float, help="stop sending new requests after this many seconds")
    r.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    r.add_argument("--out", type=Path, help="write results.json, report.md and plots here")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(
        seed=args.seed, requests=args.requests, rate=args.rate, output_tokens=args.output_tokens,
        tokenizer_dir=args.tokenizer, groups=args.groups, prompts_per_group=args.prompts_per_group,
        system_tokens=args.system_tokens, question_tokens=args.question_tokens, sessions=args.sessions,
        turns=args.turns, turn_tokens=args.turn_tokens, think_s=args.think_time, context_tokens=args.context_tokens,
        subagent_prob=args.subagent_prob, idle_s=args.idle_time, documents=args.documents,
        document_tokens=_ints(args.document_tokens), zipf=args.zipf,
        prompt_tokens=args.prompt_tokens, trace=args.trace, speed=args.speed, window_s=args.window,
        max_output_tokens=args.max_output_tokens, max_input_tokens=args.max_input_tokens,
        long_fraction=args.long_fraction, long_tokens=_ints(args.long_tokens),
        long_output_tokens=_ints(args.long_output_tokens), chat_tokens=_ints(args.chat_tokens),
        chat_output_tokens=_ints(args.chat_output_tokens),
    )


def _ints(pair: tuple[float, float]) -> tuple[int, int]:
    return int(pair[0]), int(pair[1])


def load_workload(args: argparse.Namespace, console: Console) -> list[Request] | None:
    """The workload's requests, or None after printing why it cannot be built."""
    try:
        requests = build_workload(args.workload, workload_options(args))
    except (ValueError, OSError, TraceError) as e:
        console.print(f"[red]cannot build workload {args.workload!r}: {e}")
        return None
    if not requests:
        console.print(f"[red]workload {args.workload!r} has no requests with these options")
        return None
    return requests


def run_config(args: argparse.Namespace, target: str, spread: tuple[str, ...] = ()) -> RunConfig:
    return RunConfig(target, args.model, args.concurrency, args.duration, args.timeout, not args.no_progress, spread,
                     args.api)


def drive(requests: list[Request], config: RunConfig) -> list[RequestRecord]:
    records, _ = asyncio.run(run_workload(requests, config))
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--name", default="run", help="label of this run in the report (default 'run')")
    add_workload_arguments(parser)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=not sys.stdout.isatty())
    requests = load_workload(args, console)
    if requests is None:
        return 2
    records = drive(requests, run_config(args, args.target))
    summaries = {args.name: summarize(records)}
    api = f" ({args.api} API)" if args.api != "chat" else ""
    title = f"kvgate loadgen: {args.workload} → {args.target}{api}"
    print_table(title, summaries, {}, console)
    warning = schedule_warning(summaries[args.name])
    if warning:
        console.print(f"[yellow]warning: {warning}")
    if args.out:
        meta = {"workload": args.workload, "target": args.target, "api": args.api, "seed": args.seed,
                "working_set_tokens": working_set_tokens(requests), "argv": " ".join(sys.argv[1:])}
        write_results(args.out, meta, {args.name: records}, summaries, {}, title)
        plots = write_plots(args.out, {args.name: records}, summaries, {})
        console.print(f"wrote {args.out}/results.json, report.md" + (f" and {len(plots)} plots" if plots else " (no matplotlib: no plots)"))
    return 0 if summaries[args.name]["ok"] else 1
