"""How the load generator sends a workload's request through one API family, as that API's clients send it, and
reads its streamed answer: the path, the body, the headers, and which events carry text, usage and the end.

A workload is built once, in chat completions terms (``messages``, or a completion's ``prompt``); ``--api`` picks the
front door its chat requests go through: ``chat`` (``/v1/chat/completions``), ``messages`` (Anthropic's
``/v1/messages``, shaped as Claude Code sends it) or ``responses`` (OpenAI's ``/v1/responses``). Completion
requests always go to ``/v1/completions``. The bodies keep the prompt the engine renders: vLLM turns each API's
request into the same chat, so a workload's prompt lengths and oracle hits hold whatever the API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvgate.loadgen.workloads.request import Request

Api = Literal["chat", "messages", "responses"]
APIS: tuple[Api, ...] = ("chat", "messages", "responses")
ANTHROPIC_VERSION = "2023-06-01"
EPHEMERAL = {"type": "ephemeral"}
"""Claude Code's prompt-caching breakpoint."""


@dataclass(frozen=True, slots=True)
class Usage:
    """The engine's count of one request's tokens, in chat completions terms."""

    prompt_tokens: int | None
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """What one streamed event says: it carries generated text, the request's usage, the stream's end, an error,
    or the id the engine answered under."""

    text: bool = False
    usage: Usage | None = None
    done: bool = False
    error: str | None = None
    upstream_id: str | None = None


class Wire(Protocol):
    """One API family as the runner speaks it."""

    path: str
    last_event: str
    """The event a complete stream ends with (named in the error of a stream cut short)."""

    def body(self, request: Request, model: str) -> dict[str, Any]: ...

    def headers(self, request: Request) -> dict[str, str]: ...

    def read(self, event: dict[str, Any]) -> StreamEvent: ...


class OpenAIWire:
    """``/v1/chat/completions`` or ``/v1/completions``: the workload's body with ``max_tokens``, ``ignore_eos`` and
    ``stream_options.include_usage`` (the usage comes in the last chunk), the session in ``X-Session-ID``."""

    last_event = "[DONE]"

    def __init__(self, path: str) -> None:
        self.path = path

    def body(self, request: Request, model: str) -> dict[str, Any]:
        return {**request.body, "model": model, "max_tokens": request.output_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    def headers(self, request: Request) -> dict[str, str]:
        return {"X-Session-ID": request.session_id} if request.session_id else {}

    def read(self, event: dict[str, Any]) -> StreamEvent:
        if "error" in event:
            return StreamEvent(error=json.dumps(event["error"])[:500])
        upstream = None
        if isinstance(event.get("id"), str):
            upstream = event["id"].removeprefix("chatcmpl-").removeprefix("cmpl-")
        text = any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices") or [])
        usage = event.get("usage")
        if not usage:
            return StreamEvent(text=text, upstream_id=upstream)
        details = usage.get("prompt_tokens_details") or {}
        return StreamEvent(text=text, upstream_id=upstream, usage=Usage(
            usage.get("prompt_tokens"), details.get("cached_tokens") or 0, usage.get("completion_tokens") or 0))


class MessagesWire:
    """Anthropic's ``/v1/messages`` as Claude Code calls it (:func:`messages_body`), with ``anthropic-version`` and
    the session in ``x-claude-code-session-id``. The first text comes in a ``content_block_delta``; the usage in
    ``message_delta``, where the prompt is what was read from the cache, written to it and neither."""

    path = "/v1/messages"
    last_event = "message_stop"

    def body(self, request: Request, model: str) -> dict[str, Any]:
        return messages_body(request.body["messages"], model, request.output_tokens, request.body.get("tools"))

    def headers(self, request: Request) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if request.session_id:
            headers["x-claude-code-session-id"] = request.session_id
        return headers

    def read(self, event: dict[str, Any]) -> StreamEvent:
        kind = event.get("type")
        if kind == "error":
            return StreamEvent(error=json.dumps(event.get("error"))[:500])
        if kind == "message_start":
            message_id = (event.get("message") or {}).get("id")
            return StreamEvent(upstream_id=message_id.removeprefix("chatcmpl-") if isinstance(message_id, str)
                               else None)
        if kind == "content_block_delta":
            return StreamEvent(text=bool((event.get("delta") or {}).get("text")))
        if kind == "message_delta":
            usage = event.get("usage") or {}
            read = usage.get("cache_read_input_tokens") or 0
            written = usage.get("cache_creation_input_tokens") or 0
            prompt = usage["input_tokens"] + read + written if isinstance(usage.get("input_tokens"), int) else None
            return StreamEvent(usage=Usage(prompt, read, usage.get("output_tokens") or 0))
        return StreamEvent(done=kind == "message_stop")


class ResponsesWire:
    """OpenAI's ``/v1/responses`` as the openai client calls it (:func:`responses_body`), not stored (the workload
    sends each turn's whole history), with vLLM's ``ignore_eos`` and the session in ``X-Session-ID``. Text comes in
    ``response.output_text.delta``; the usage, cached tokens included in ``input_tokens``, in
    ``response.completed``, the last event."""

    path = "/v1/responses"
    last_event = "response.completed"

    def body(self, request: Request, model: str) -> dict[str, Any]:
        return {**responses_body(request.body["messages"], model, request.output_tokens, request.body.get("tools")),
                "ignore_eos": True}

    def headers(self, request: Request) -> dict[str, str]:
        return {"X-Session-ID": request.session_id} if request.session_id else {}

    def read(self, event: dict[str, Any]) -> StreamEvent:
        kind = event.get("type")
        if kind in ("error", "response.failed"):
            return StreamEvent(error=json.dumps(event)[:500])
        if kind == "response.output_text.delta":
            return StreamEvent(text=bool(event.get("delta")))
        if kind == "response.completed":
            usage = (event.get("response") or {}).get("usage") or {}
            details = usage.get("input_tokens_details") or {}
            return StreamEvent(done=True, usage=Usage(usage.get("input_tokens"), details.get("cached_tokens") or 0,
                                                      usage.get("output_tokens") or 0))
        return StreamEvent()


CHAT = OpenAIWire("/v1/chat/completions")
COMPLETIONS = OpenAIWire("/v1/completions")
WIRES: dict[str, Wire] = {"chat": CHAT, "messages": MessagesWire(), "responses": ResponsesWire()}


def wire_for(request: Request, api: Api) -> Wire:
    """The API a workload request goes through: ``api`` for a chat request, completions for a completion."""
    return COMPLETIONS if request.endpoint == "completions" else WIRES[api]


def messages_body(
    messages: list[dict[str, Any]], model: str, max_tokens: int, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A chat request as Claude Code sends it to ``/v1/messages``: a leading system message as ``system`` text
    blocks, each turn's text as text blocks, tool calls as ``tool_use`` blocks, tool results as ``tool_result``
    blocks of one user turn (with the user's text that follows them), Claude Code's rolling cache breakpoints
    (``cache_control`` on the last system block and on the last block of the last user turn), and the tools.

    vLLM renders that as the chat: the system text and the inline system messages after the first are kept as they
    were, text blocks of one turn are joined with a newline as text parts are, and tool results come out as tool
    messages ahead of the turn's text. A turn with no text is an empty string (vLLM drops empty text blocks, and
    with them a user turn that has nothing else); an empty system message has no Messages form and is left out."""
    system: list[dict[str, Any]] = []
    rest = messages
    if messages and messages[0]["role"] == "system":
        system = [b for b in _text_blocks(messages[0].get("content")) if b["text"]]
        rest = messages[1:]
    turns: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn the latest tool results went into
    for message in rest:
        role = message["role"]
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": message.get("tool_call_id") or "",
                     "content": _text(message.get("content"))}
            if results is None:
                results = {"role": "user", "content": []}
                turns.append(results)
            results["content"].append(block)
            continue
        blocks = [b for b in _text_blocks(message.get("content")) if b["text"]]
        if role == "user" and results is not None and blocks:
            results["content"] += blocks
            results = None
            continue
        results = None
        if role == "assistant":
            blocks += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"].get("arguments") or "{}")}
                       for call in message.get("tool_calls") or []]
            turns.append({"role": "assistant", "content": blocks or ""})
        elif role == "user":
            turns.append({"role": "user", "content": blocks or ""})
        else:  # a system message after the first: vLLM's inline system message
            turns.append({"role": "system", "content": _text(message.get("content"))})
    last_user = next((t for t in reversed(turns) if t["role"] == "user" and t["content"]), None)
    if last_user is not None and isinstance(last_user["content"], list):
        last_user["content"][-1] = {**last_user["content"][-1], "cache_control": EPHEMERAL}
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": turns, "stream": True}
    if system:
        system[-1] = {**system[-1], "cache_control": EPHEMERAL}
        body["system"] = system
    if tools:
        body["tools"] = [_anthropic_tool(t) for t in tools]
    return body


def responses_body(
    messages: list[dict[str, Any]], model: str, max_output_tokens: int, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A chat request as the openai client sends it to ``/v1/responses``: a leading system message as
    ``instructions``, each other message as a message item (``input_text`` parts, ``output_text`` for the
    assistant's), tool calls as ``function_call`` items and tool results as ``function_call_output`` items, the
    tools flat. vLLM merges an assistant message and the function calls after it back into one assistant message."""
    items: list[dict[str, Any]] = []
    instructions = None
    rest = messages
    if messages and messages[0]["role"] == "system":
        instructions = _text(messages[0].get("content"))
        rest = messages[1:]
    for message in rest:
        role = message["role"]
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id") or "",
                          "output": _text(message.get("content"))})
            continue
        text = _text(message.get("content"))
        calls = message.get("tool_calls") or []
        if role != "assistant" or text or not calls:
            part = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "role": role, "content": [{"type": part, "text": text}]})
        items += [{"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                   "arguments": call["function"].get("arguments") or "{}"} for call in calls]
    body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": max_output_tokens, "stream": True,
                            "store": False}
    if instructions is not None:
        body["instructions"] = instructions
    if tools:
        body["tools"] = [{"type": "function", **t["function"]} for t in tools]
    return body


def _text(content: Any) -> str:
    """A chat message's text: its string, or its text parts joined with a newline (as vLLM joins them)."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _text_blocks(content: Any) -> list[dict[str, Any]]:
    parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
    return [{"type": "text", "text": part.get("text", "")} for part in parts if isinstance(part, dict)]


def _anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    out: dict[str, Any] = {"name": function["name"]}
    if function.get("description") is not None:
        out["description"] = function["description"]
    out["input_schema"] = function.get("parameters") or {"type": "object"}
    return out
