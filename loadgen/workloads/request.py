"""What a workload is made of: the requests a run sends, and the options every workload builder reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgate.loadgen.assets import TOKENIZER_DIR

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    arrival_s: float
    """Offset from the start of the run; for a follow-up turn, the think time after the previous turn ended."""
    endpoint: Endpoint
    body: dict[str, Any]
    """``prompt`` or ``messages`` only; the runner adds model, max_tokens and streaming fields."""
    output_tokens: int
    prompt_tokens: int
    """Prompt length in tokens, as the engine will count it."""
    oracle_hit_tokens: int
    """Leading tokens an infinite fleet-wide prefix cache would already hold (see ``oracle.PrefixOracle``)."""
    session_id: str | None = None
    after: int | None = None
    """Index of the request this one follows (the previous turn of a chat session); it is sent only once that one
    has finished, ``arrival_s`` later."""
    chain: tuple[int, ...] = ()
    """The prompt's prefix chain, one node per full block of ``oracle.ORACLE_BLOCK_SIZE`` tokens
    (``oracle.PrefixOracle.observe``): equal nodes, equal prefixes. The report's copies audit follows prefixes
    across replicas with it."""


@dataclass(frozen=True)
class WorkloadOptions:
    """Every knob of every workload; each workload reads the ones it needs."""

    seed: int = 0
    requests: int | None = None
    """Upper bound on the number of requests (for trace: the first N of the window)."""
    rate: float = 8.0
    """Poisson arrival rate (requests or sessions per second); 0 sends everything at once."""
    output_tokens: int = 64
    tokenizer_dir: Path = TOKENIZER_DIR
    # shared-prefix
    groups: int = 8
    prompts_per_group: int = 16
    system_tokens: int = 2048
    question_tokens: int = 128
    # multi-turn
    sessions: int = 16
    turns: int = 5
    turn_tokens: int = 256
    think_s: float = 1.0
    # agentic (also: sessions, turns, system_tokens, think_s)
    context_tokens: int = 100_000
    """The context a session grows toward (each session's own target is drawn around it)."""
    subagent_prob: float = 0.25
    idle_s: float = 30.0
    """Mean of the occasional long pause between turns (the user, not a tool, is what the agent waits for)."""
    # documents
    documents: int = 16
    document_tokens: tuple[int, int] = (10_000, 40_000)
    zipf: float = 1.1
    # unique
    prompt_tokens: int = 1024
    # trace
    trace: Path | None = None
    speed: float = 1.0
    window_s: tuple[float, float] | None = None
    max_output_tokens: int | None = None
    max_input_tokens: int | None = None
    """Trace: skip rows with longer prompts (e.g. beyond the engines' max_model_len, which would only yield 400s)."""
    # pd-mix (also: rate, speed, requests)
    long_fraction: float = 0.25
    long_tokens: tuple[int, int] = (4_000, 16_000)
    long_output_tokens: tuple[int, int] = (256, 1_024)
    chat_tokens: tuple[int, int] = (64, 512)
    chat_output_tokens: tuple[int, int] = (16, 256)


def working_set_tokens(requests: list[Request]) -> int:
    """Distinct prompt tokens of a workload: what an infinite cache would end up holding (each request's tokens
    beyond its oracle hit). Compared with the fleet's KV, it says whether the workload binds cache capacity."""
    return sum(r.prompt_tokens - r.oracle_hit_tokens for r in requests)
