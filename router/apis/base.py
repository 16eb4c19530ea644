"""One API, as the gateway sees it: :class:`Api` is what a front door's body knowledge provides, and :class:`Usage`
the engine's token counts an answer carries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.router.core.errors import ErrorShape
from kvgate.router.prompts.prompt import Prompt


@dataclass(slots=True, frozen=True)
class Usage:
    """The engine's own counts of one answer: prompt tokens, output tokens, and prompt tokens it served from its
    prefix cache (None when it does not say)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class Api:
    """What the gateway needs to know of one API's bodies, as functions of them; nothing else in the gateway reads an
    API's field names."""

    name: str
    """What metrics, logs and explain call it (``chat``, ``completions``)."""
    path: str
    """The engine's path for it."""
    prompt_param: str
    """The request field an error about the prompt names (``messages``, ``prompt``)."""
    prompt: Callable[[dict[str, Any]], Prompt]
    """The prompt the engine renders from a request body; raises ``PromptError`` for a body it would refuse."""
    max_tokens: Callable[[dict[str, Any]], int | None]
    """The request's output budget, when it states one."""
    holds_output: Callable[[bytes], bool]
    """Whether the start of a streamed answer holds its first output (the first token, an error, its end)."""
    stream_complete: Callable[[bytes], bool]
    """Whether the tail of a streamed answer holds the stream's own end (a stream cut short lacks it)."""
    errors: ErrorShape
    """How the API writes an error: kvgate's refusals, the events that end a stream under way, an engine's errors."""
    session_of: Callable[[dict[str, Any]], str | None]
    """A session key the body carries (OpenAI's ``prompt_cache_key``), for a client that sends no session header."""
    usage_of_body: Callable[[bytes], Usage | None]
    """The engine's counts in an answer read whole."""
    usage_of_stream_tail: Callable[[bytes], Usage | None]
    """The engine's counts in the tail of a streamed answer."""
    prefill_only: Callable[[dict[str, Any]], dict[str, Any]]
    """The request as a prefill-only leg: same prompt, one output token, not streamed (a KV transfer's first leg)."""
    not_streamed: Callable[[dict[str, Any]], dict[str, Any]]
    """The request not streamed, whatever it asked (a handoff's prefill leg, whose answer is dropped)."""
