"""How a generation's answer is written: the interface every API's answer implements, and vLLM's OpenAI chat
completions and completions answers.

The replica's HTTP layer (``api.py``) runs one generation the same way for every API and hands its progress to an
:class:`Answer`: the whole body once the request has ended, or, when streamed, the bytes to send as the stream opens,
when the first token is there, for each token, and when the request has ended. So an API's events come exactly when
vLLM's would, off the same engine steps: TTFT is the first token's time for every API.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from .engine import SimRequest
from .model import SimModel

_json_encode = msgspec.json.Encoder().encode

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class Answer(Protocol):
    """One request's answer in its API's shape. ``body`` is the non-streamed answer; a stream is ``opening``, then
    ``first`` and each ``token`` as tokens come (``last`` on the final one), then ``closing``."""

    def body(self, req: SimRequest) -> dict[str, Any]: ...

    def opening(self) -> bytes: ...

    def first(self, req: SimRequest) -> bytes: ...

    def token(self, req: SimRequest, token_id: int, last: bool) -> bytes: ...

    def closing(self, req: SimRequest) -> bytes: ...


def sse(obj: dict[str, Any]) -> bytes:
    """One ``data:`` event (the OpenAI endpoints' framing)."""
    return b"data: " + _json_encode(obj) + b"\n\n"


def named_sse(event: str, obj: dict[str, Any]) -> bytes:
    """One ``event: <name>`` / ``data:`` event (the Messages and Responses endpoints' framing)."""
    return b"event: " + event.encode() + b"\ndata: " + _json_encode(obj) + b"\n\n"


def cache_creation_tokens(req: SimRequest, block_size: int) -> int:
    """vLLM's ``num_cache_creation_tokens`` (``PrefillStats.finalize``): the prompt tokens in full blocks the
    request holds once its prefill is done, less those it found cached. A prompt that fills its last block exactly
    recomputes that block, so it counts as created even when it was cached."""
    return max(0, req.prompt_len // block_size * block_size - req.cached_tokens)


def chat_usage(req: SimRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_len, "total_tokens": req.prompt_len + len(req.output),
        "completion_tokens": len(req.output), "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


class ChatAnswer:
    """``/v1/chat/completions``: a ``chat.completion``, or ``chat.completion.chunk`` events opened by the role chunk
    and closed by the usage chunk (when ``stream_options.include_usage``) and ``[DONE]``. The role chunk goes out as
    the stream opens (vLLM sends it with the first token); the first content chunk comes with the first token."""

    def __init__(self, request_id: str, model: SimModel, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model.name}

    def body(self, req: SimRequest) -> dict[str, Any]:
        message = {"role": "assistant", "content": self.model.text(req.output), "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
        return {
            "id": self.head["id"], "object": "chat.completion", "created": self.head["created"],
            "model": self.model.name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None}],
            "service_tier": None, "system_fingerprint": None, "usage": chat_usage(req), "prompt_logprobs": None,
            "kv_transfer_params": req.kv_transfer_params_out,
        }

    def opening(self) -> bytes:
        return sse({**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})

    def first(self, req: SimRequest) -> bytes:
        return b""

    def token(self, req: SimRequest, token_id: int, last: bool) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": self.model.token_text[token_id]}, "logprobs": None,
                                  "finish_reason": "length" if last else None}
        if last:
            choice["stop_reason"] = None
        return sse({**self.head, "choices": [choice]})

    def closing(self, req: SimRequest) -> bytes:
        usage = sse({**self.head, "choices": [], "usage": chat_usage(req)}) if self.include_usage else b""
        return usage + b"data: [DONE]\n\n"


class CompletionAnswer:
    """``/v1/completions``: a ``text_completion``, or its chunks closed by the usage chunk and ``[DONE]``."""

    def __init__(self, request_id: str, model: SimModel, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                     "model": model.name}

    def body(self, req: SimRequest) -> dict[str, Any]:
        return {
            **self.head,
            "choices": [{"index": 0, "text": self.model.text(req.output), "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "prompt_logprobs": None}],
            "service_tier": None, "system_fingerprint": None, "usage": chat_usage(req),
            "kv_transfer_params": req.kv_transfer_params_out,
        }

    def opening(self) -> bytes:
        return b""

    def first(self, req: SimRequest) -> bytes:
        return b""

    def token(self, req: SimRequest, token_id: int, last: bool) -> bytes:
        return sse({**self.head, "choices": [{"index": 0, "text": self.model.token_text[token_id], "logprobs": None,
                                              "finish_reason": "length" if last else None, "stop_reason": None}]})

    def closing(self, req: SimRequest) -> bytes:
        usage = sse({**self.head, "choices": [], "usage": chat_usage(req)}) if self.include_usage else b""
        return usage + b"data: [DONE]\n\n"
