"""Trace replay. Two formats:

* Mooncake (``.jsonl``): one JSON object per line with timestamp (ms), input_length, output_length and hash_ids, one
  id per 512-token block, chained so that equal ids at position i mean equal prefixes up to block i.
* Azure LLM inference (``.csv``, the Splitwise traces): a ``TIMESTAMP,ContextTokens,GeneratedTokens`` header, then one
  row per request with its arrival time and token counts and no prefix information: every request's blocks get ids
  of their own, so no two prompts share anything and routing can only balance the load.

Each hash id becomes a deterministic block of 512 round-trip-safe word tokens (keyed by seed and id), so two requests
share exactly the prefix the trace says they share, and the text prompt tokenizes back to exactly those ids. The
conversation trace's timestamps are quantised to ~3 s ticks; replaying them as they are would send up to 28 requests
in one burst, so each arrival is jittered uniformly within its tick.
"""

from __future__ import annotations

import csv
import json
import random
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvgate.loadgen.workloads.oracle import PrefixOracle
from kvgate.loadgen.workloads.request import Request, WorkloadOptions
from kvgate.loadgen.workloads.vocabulary import vocabulary_for

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_trace(path: Path) -> list[TraceRow]:
    """The trace's rows in arrival order, read as Azure CSV when the file name ends in ``.csv``, else as Mooncake."""
    return read_azure_trace(path) if path.suffix.lower() == ".csv" else read_mooncake_trace(path)


def read_mooncake_trace(path: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                row = TraceRow(
                    int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{n}: not a Mooncake trace row: {e}") from e
            if row.input_length <= 0 or len(row.hash_ids) * TRACE_BLOCK_TOKENS < row.input_length:
                raise TraceError(f"{path}:{n}: {len(row.hash_ids)} hash ids cannot cover {row.input_length} tokens")
            rows.append(row)
    return sorted(rows, key=lambda r: r.timestamp_ms)


def read_azure_trace(path: Path) -> list[TraceRow]:
    """Azure rows with timestamps in ms from the earliest arrival, and fresh block ids for every request (the trace
    says nothing about shared prefixes)."""
    parsed: list[tuple[datetime, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(column.strip() for column in header) != AZURE_COLUMNS:
            expected = ",".join(AZURE_COLUMNS)
            raise TraceError(f"{path}:1: not an Azure LLM inference trace (its header must be {expected})")
        for n, fields in enumerate(reader, 2):
            if not fields:
                continue
            try:
                stamp, context, generated = fields
                row = (_azure_time(stamp), int(context), int(generated))
            except ValueError as e:
                raise TraceError(f"{path}:{n}: not an Azure trace row: {e}") from e
            if row[1] <= 0 or row[2] < 0:
                raise TraceError(f"{path}:{n}: a prompt needs at least one token and an output none below zero")
            parsed.append(row)
    if not parsed:
        return []
    parsed.sort(key=lambda row: row[0])
    start = parsed[0][0]
    rows: list[TraceRow] = []
    next_id = 0
    for stamp, context, generated in parsed:
        blocks = -(-context // TRACE_BLOCK_TOKENS)
        rows.append(TraceRow(round((stamp - start).total_seconds() * 1000), context, generated,
                             tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    return rows


def _azure_time(stamp: str) -> datetime:
    """``2023-11-16 18:15:46.6805900``: the trace writes seven fractional digits, one more than datetime takes."""
    whole, dot, fraction = stamp.strip().partition(".")
    return datetime.fromisoformat(f"{whole}.{fraction[:6]:0<6}" if dot else whole)


def timestamp_tick_ms(rows: list[TraceRow]) -> float:
    """The trace's timestamp quantum: the median gap between distinct timestamps when most rows share their
    timestamp with another row (quantised arrivals), else 0 (arrivals are already spread, nothing to jitter)."""
    distinct = sorted({r.timestamp_ms for r in rows})
    if len(distinct) < 2 or len(distinct) > len(rows) / 2:
        return 0.0
    return float(statistics.median(b - a for a, b in zip(distinct, distinct[1:])))


def select_rows(rows: list[TraceRow], options: WorkloadOptions) -> list[TraceRow]:
    """The time window [A, B) seconds of trace time, without prompts over ``max_input_tokens``, then the first N."""
    if options.window_s is not None:
        start_ms, end_ms = options.window_s[0] * 1000, options.window_s[1] * 1000
        rows = [r for r in rows if start_ms <= r.timestamp_ms < end_ms]
    if options.max_input_tokens is not None:
        rows = [r for r in rows if r.input_length <= options.max_input_tokens]
    if options.requests is not None:
        rows = rows[: options.requests]
    return rows


def trace_workload(options: WorkloadOptions) -> list[Request]:
    if options.trace is None:
        raise ValueError("the trace workload needs a trace file (--trace)")
    if options.speed <= 0:
        raise ValueError("--speed must be positive")
    all_rows = read_trace(options.trace)
    tick_ms = timestamp_tick_ms(all_rows)
    rows = select_rows(all_rows, options)
    vocab = vocabulary_for(options.tokenizer_dir)
    rng = random.Random(f"trace:{options.seed}")
    oracle = PrefixOracle()
    blocks: dict[int, list[int]] = {}
    origin_ms = options.window_s[0] * 1000 if options.window_s is not None else 0.0
    timed = []
    for row in rows:
        jittered = row.timestamp_ms + rng.uniform(0, tick_ms) - origin_ms
        timed.append((max(jittered, 0.0) / 1000 / options.speed, row))
    timed.sort(key=lambda pair: pair[0])
    requests = []
    for index, (arrival_s, row) in enumerate(timed):
        ids: list[int] = []
        for h in row.hash_ids:
            block = blocks.get(h)
            if block is None:
                block = blocks[h] = vocab.sample(random.Random(f"trace:{options.seed}:block:{h}"), TRACE_BLOCK_TOKENS)
            ids.extend(block)
        del ids[row.input_length :]
        output = row.output_length if options.max_output_tokens is None else min(row.output_length, options.max_output_tokens)
        hits, chain = oracle.observe(ids)
        requests.append(
            Request(index, arrival_s, "completions", {"prompt": vocab.render(ids)}, max(output, 1), len(ids), hits,
                    chain=chain)
        )
    return requests
