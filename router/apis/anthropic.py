"""Anthropic's Messages API (Claude Code's), as vLLM serves it and the gateway needs to know it: :data:`MESSAGES` and
:data:`COUNT_TOKENS`.

- **Prompts.** vLLM turns a Messages body into a chat conversation and renders that with the model's chat template
  (``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request``); :func:`conversation` is the same
  conversion, step for step, so the gateway's token ids are the engine's. The leading system prompt joins the
  ``system`` field's text blocks with nothing between them, dropping Claude Code's per-request
  ``x-anthropic-billing-header`` block; a user turn's ``tool_result`` blocks become ``tool`` messages placed before
  the rest of that turn; ``tool_use`` blocks become tool calls; ``thinking`` becomes the message's reasoning. Inline
  ``system`` messages stay where they are unless the template takes no system message after the first, in which case
  vLLM merges them into the leading one: both conversations are made, and the renderer picks by its probe of the
  template (:attr:`~kvgate.router.prompts.prompt.ChatPrompt.system_merged`).
- **Bodies** are validated as vLLM's request models validate them (``vllm/entrypoints/anthropic/protocol.py``):
  a body the engine would refuse is refused here, in Anthropic's error shape, before it costs a replica anything.
- **Streams** are Anthropic's named events. ``message_start`` comes before any output (vLLM sends it with the first
  token, other servers at once), so a stream's first output is its first other event; it ends with
  ``message_stop``; the engine's counts are in ``message_delta``'s ``usage``.
- **Usage.** ``input_tokens`` leaves out what the cache served (``cache_read_input_tokens``) and what this request
  wrote to it (``cache_creation_input_tokens``): the prompt is their sum.
- **cache_control** breakpoints on tools or system mark the prefix every session sends again
  (:func:`shared_prefix_end`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from kvgate.router.apis.base import Api, Usage
from kvgate.router.apis.fields import chat_template_of, one_of, optional
from kvgate.router.apis.openai import MAX_HELD_BYTES, MEDIA_PART_TYPES, engine_tools
from kvgate.router.apis.sse import complete_events, event
from kvgate.router.core.errors import ErrorShape
from kvgate.router.prompts.prompt import ChatPrompt, PromptError, plain_text

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's first system block: a per-request hash that would defeat the prefix cache, so vLLM drops it."""
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
                         "tool_addition", "tool_removal"})
"""The content blocks vLLM 0.32 accepts; any other (``document``, ``search_result``, server tools) is a 400 there."""
TOOL_CHANGES = frozenset({"tool_addition", "tool_removal"})
ROLES = frozenset({"user", "assistant", "system"})
TOOL_CHOICES = frozenset({"auto", "any", "tool", "none"})
EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
MAX_STOP_SEQUENCES = 4
"""vLLM's ``VLLM_MAX_STOP_STRINGS`` default."""
MIN_THINKING_BUDGET = 1024

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error types by status; any other 4xx is an ``invalid_request_error``, any other 5xx an ``api_error``."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"type": "error", "error": {"type": error_type(status), "message": message}})


def _engine_error(status: int, body: bytes, content_type: str | None) -> tuple[bytes, str]:
    """An engine's error in Anthropic's shape: vLLM answers some in it (with its own type names) and the ones its
    framework raises (a body that fails validation) in OpenAI's; the message is kept, the type is Anthropic's."""
    message = f"the upstream replica answered {status}"
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        inner = decoded.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            message = inner["message"]
        elif isinstance(decoded.get("detail"), str):
            message = decoded["detail"]
    return _error_body(status, message), "application/json"


ANTHROPIC_ERRORS = ErrorShape(
    body=lambda err: _error_body(err.status, err.message),
    stream_events=lambda err: event("error", _error_body(err.status, err.message)),
    from_engine=_engine_error,
)
"""``{"type": "error", "error": {"type", "message"}}``; mid-stream, an ``error`` event."""


# --- validation, as vLLM's request models do it ---------------------------------------------------------------------


def _blocks(content: Any, param: str, role: str) -> list[dict[str, Any]] | str:
    """A message's (or the ``system`` field's) content: a string or a list of blocks of known types and field types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError("content must be a string or a list of content blocks", param)
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(block, dict) or not one_of(block.get("type"), BLOCK_TYPES):
            raise PromptError(f"unsupported content block type {_type_of(block)!r}", f"{where}.type")
        for name, kind in (("text", str), ("source", dict), ("id", str), ("tool_use_id", str), ("name", str),
                           ("input", dict), ("is_error", bool), ("tool_name", str), ("thinking", str),
                           ("signature", str), ("data", str)):
            optional(block, name, kind, f"{where}.{name}")
        result = block.get("content")
        if result is not None and not isinstance(result, str) and not (
                isinstance(result, list) and all(isinstance(item, dict) for item in result)):
            raise PromptError("a block's 'content' must be a string or a list of objects", f"{where}.content")
        if block["type"] in TOOL_CHANGES:
            _check_tool_change(block, where, role)
    return content


def _type_of(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else type(block).__name__


def _check_tool_change(block: dict[str, Any], where: str, role: str) -> None:
    if role != "system":
        raise PromptError(f'{block["type"]} blocks are only allowed in messages with role "system"', where)
    tool = block.get("tool")
    tool = tool if isinstance(tool, dict) else {}
    if tool.get("type") == "tool_reference" and isinstance(tool.get("name"), str):
        return
    if tool.get("type") == "tool_definition" and block["type"] == "tool_addition" \
            and isinstance(tool.get("definition"), dict):
        _check_tool(tool["definition"], f"{where}.tool.definition")
        return
    raise PromptError(f"{block['type']} needs a tool_reference (or, to add one, a tool_definition)", f"{where}.tool")


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
            or not isinstance(tool.get("input_schema"), dict):
        raise PromptError("a tool must be an object with a string 'name' and an object 'input_schema'", where)
    optional(tool, "description", str, f"{where}.description")
    optional(tool, "strict", bool, f"{where}.strict")
    optional(tool, "defer_loading", bool, f"{where}.defer_loading")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise PromptError("'messages' must be a list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not one_of(message.get("role"), ROLES):
            raise PromptError("a message must be an object with role user, assistant or system", f"messages.{i}.role")
        _blocks(message.get("content"), f"messages.{i}.content", message["role"])
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = optional(body, "tools", list)
    for i, tool in enumerate(tools or []):
        _check_tool(tool, f"tools.{i}")
    return tools


def _check_request(body: dict[str, Any], *, generates: bool) -> None:
    """What vLLM's request model refuses beyond the conversation (``generates``: ``/v1/messages``, not count_tokens)."""
    if body.get("system") is not None:
        _blocks(body["system"], "system", "user")  # the system field takes no tool changes, as a user message
    choice = optional(body, "tool_choice", dict)
    if choice is not None:
        if not one_of(choice.get("type"), TOOL_CHOICES):
            raise PromptError("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
        if choice["type"] == "tool" and not (isinstance(choice.get("name"), str) and choice["name"]):
            raise PromptError("tool_choice.name is required when type is 'tool'", "tool_choice.name")
    config = optional(body, "output_config", dict)
    if config is not None and config.get("effort") is not None and not one_of(config["effort"], EFFORTS):
        raise PromptError("output_config.effort must be one of low, medium, high, xhigh, max", "output_config.effort")
    thinking = optional(body, "thinking", dict)
    if thinking is not None and thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise PromptError("thinking.type must be enabled, disabled or adaptive", "thinking.type")
    enabled = thinking is not None and thinking["type"] == "enabled"
    budget = thinking.get("budget_tokens") if enabled else None  # type: ignore[union-attr]
    if enabled and (type(budget) is not int or budget < MIN_THINKING_BUDGET):
        raise PromptError(f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}",
                          "thinking.budget_tokens")
    if not generates:
        return
    tokens = body.get("max_tokens")
    if type(tokens) is not int or tokens <= 0:
        raise PromptError("max_tokens: a positive integer is required", "max_tokens")
    stops = optional(body, "stop_sequences", list)
    if stops is not None and (len(stops) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in stops)):
        raise PromptError(f"stop_sequences: at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    transfer = body.get("kv_transfer_params")
    prefill_leg = isinstance(transfer, dict) and bool(transfer.get("do_remote_decode"))
    if budget is not None and budget >= tokens and not prefill_leg:
        raise PromptError("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")


# --- the conversation, as vLLM converts it ---------------------------------------------------------------------------


def _system_text(content: Any) -> str | None:
    """An inline system message's text: its text blocks joined with nothing between them, billing headers dropped."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content
             if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _leading_system(body: dict[str, Any], inline: list[str]) -> list[dict[str, Any]]:
    system = body.get("system")
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += [b["text"] for b in system
                  if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)]
    parts += inline
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A user turn's tool_result: a tool message (and, after it, its images as a user message and its tool references
    as another tool message), appended at once, before the turn's own message."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _turn(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """One user or assistant message, appended to ``out`` after any tool messages its blocks produce."""
    role = message["role"]
    content = message["content"]
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            # In the order vLLM's validation of the chat request leaves a call's keys (see validated_message).
            calls.append({"id": block.get("id") or f"call_{int(time.time())}",
                          "function": {"arguments": json.dumps(block.get("input") or {}),
                                       "name": block.get("name") or ""},
                          "type": "function"})
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, out)
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if role == "assistant" or "content" in converted:
        out.append(converted)


def conversation(body: dict[str, Any], *, merge_inline_system: bool) -> list[dict[str, Any]]:
    """The OpenAI-format chat vLLM renders for a (validated) Messages body, with inline system messages merged into
    the leading one or left in place."""
    messages = body["messages"]
    inline = [t for m in messages if m["role"] == "system" and (t := _system_text(m["content"]))]
    out = _leading_system(body, inline if merge_inline_system else [])
    for message in messages:
        if message["role"] == "system":
            text = None if merge_inline_system else _system_text(message["content"])
            if text:
                out.append({"role": "system", "content": text})
            continue
        _turn(message, out)
    return out


def _resolved_tools(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` after the system messages' tool_addition and tool_removal blocks (vLLM's ``_resolve_tools``)."""
    changes = [b for m in body["messages"] if not isinstance(m["content"], str) for b in m["content"]
               if b["type"] in TOOL_CHANGES]
    if not changes:
        return tools
    by_name = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = change["definition"]
        else:
            name = change["name"]
            if name not in by_name:
                raise PromptError(f"{block['type']} references tool {name!r}, which is not declared in tools", "tools")
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools as the chat request's function tools (an ``input_schema`` without a type gets ``"type":
    "object"`` appended last, as vLLM's model validator does)."""
    if tools is None:
        return None
    converted = []
    for tool in tools:
        schema = tool["input_schema"]
        if "type" not in schema:
            schema = {**schema, "type": "object"}
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description"), "parameters": schema,
            "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}})
    return converted


def _chat_prompt(body: dict[str, Any], *, generates: bool) -> ChatPrompt:
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    messages = _messages(body)
    tools = _tools(body)
    _check_request(body, generates=generates)
    kwargs = optional(body, "chat_template_kwargs", dict)
    in_place = conversation(body, merge_inline_system=False)
    merged = conversation(body, merge_inline_system=True) if any(m["role"] == "system" for m in messages) else None
    thinking = body.get("thinking")
    config = body.get("output_config")
    has_media = any(isinstance(part, dict) and one_of(part.get("type"), MEDIA_PART_TYPES)
                    for m in in_place if isinstance(m.get("content"), list) for part in m["content"])
    return ChatPrompt(
        messages=in_place,
        add_generation_prompt=True,
        continue_final_message=False,
        add_special_tokens=False,
        chat_template=chat_template_of({}, kwargs),
        chat_template_kwargs=kwargs,
        tools=engine_tools(_openai_tools(_resolved_tools(body, tools))),
        documents=None,
        has_media=has_media,
        reasoning_effort=config.get("effort") if isinstance(config, dict) else None,
        thinking_disabled=isinstance(thinking, dict) and thinking.get("type") == "disabled",
        system_merged=merged,
        shared_prefix_end=shared_prefix_end(body, in_place),
    )


def parse_messages(body: dict[str, Any]) -> ChatPrompt:
    """The prompt of a ``/v1/messages`` body, validated as vLLM validates it."""
    return _chat_prompt(body, generates=True)


def parse_count_tokens(body: dict[str, Any]) -> ChatPrompt:
    """The prompt of a ``/v1/messages/count_tokens`` body (no ``max_tokens``; the same conversation)."""
    return _chat_prompt(body, generates=False)


def shared_prefix_end(body: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
    """Where the prefix the client marked as one every session sends again ends: a ``cache_control`` breakpoint on a
    tool or a system block covers tools and system, which the template renders ahead of the conversation, so the
    prefix ends where the conversation's first text begins (``messages``: the converted chat). None without such a
    breakpoint, or when the conversation has no text to find."""
    system = body.get("system")
    marked = any(isinstance(tool, dict) and tool.get("cache_control") for tool in body.get("tools") or []) or (
        isinstance(system, list) and any(isinstance(b, dict) and b.get("cache_control") for b in system))
    if not marked:
        return None
    for message in messages:
        if message["role"] != "system" and (text := plain_text(message.get("content"))):
            return text
    return None


# --- answers ---------------------------------------------------------------------------------------------------------


def max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_tokens")
    return value if type(value) is int else None


PREAMBLE_EVENTS = frozenset({b"message_start", b"ping"})
"""Events a stream sends before any output."""


def holds_output(buffer: bytes) -> bool:
    """True once the stream's start has a complete event that is not ``message_start`` or ``ping``."""
    if len(buffer) >= MAX_HELD_BYTES:
        return True
    return any(name not in PREAMBLE_EVENTS for name, _ in complete_events(buffer))


def stream_complete(tail: bytes) -> bool:
    return b"message_stop" in tail


class _AnthropicUsage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None

    def counts(self) -> Usage:
        prompt = self.input_tokens + (self.cache_read_input_tokens or 0) + (self.cache_creation_input_tokens or 0)
        return Usage(prompt, self.output_tokens, self.cache_read_input_tokens)


class _UsageCarrier(msgspec.Struct):
    usage: _AnthropicUsage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


def usage_of_body(body: bytes) -> Usage | None:
    try:
        usage = _usage_decoder.decode(body).usage
    except msgspec.DecodeError:
        return None
    return usage.counts() if usage is not None else None


def usage_of_stream_tail(tail: bytes) -> Usage | None:
    """The last ``message_delta``'s usage (vLLM puts the whole count there, cache reads included)."""
    for name, data in reversed(list(complete_events(tail, tail=True))):
        if name == b"message_delta" or b'"message_delta"' in data[:40]:
            usage = usage_of_body(data)
            if usage is not None:
                return usage
    return None


def prefill_only(body: dict[str, Any]) -> dict[str, Any]:
    """Same prompt, one token, not streamed (a transfer's first leg)."""
    return {**body, "stream": False, "max_tokens": 1}


def not_streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": False}


def no_session(body: dict[str, Any]) -> str | None:
    """Messages bodies carry no session key (Claude Code sends its session in a header)."""
    return None


MESSAGES = Api(
    name="messages", path="/v1/messages", prompt_param="messages", prompt=parse_messages, max_tokens=max_tokens,
    holds_output=holds_output, stream_complete=stream_complete, errors=ANTHROPIC_ERRORS, session_of=no_session,
    usage_of_body=usage_of_body, usage_of_stream_tail=usage_of_stream_tail, prefill_only=prefill_only,
    not_streamed=not_streamed,
)
class _TokenCount(msgspec.Struct):
    input_tokens: int | None = None


_count_decoder = msgspec.json.Decoder(_TokenCount)


def count_of_body(body: bytes) -> Usage | None:
    """count_tokens' answer, ``{"input_tokens": N, ...}``: the engine's count of the whole prompt."""
    try:
        count = _count_decoder.decode(body).input_tokens
    except msgspec.DecodeError:
        return None
    return Usage(count, 0, None) if count is not None else None


COUNT_TOKENS = Api(
    name="count_tokens", path="/v1/messages/count_tokens", prompt_param="messages", prompt=parse_count_tokens,
    max_tokens=lambda body: None, holds_output=holds_output, stream_complete=stream_complete,
    errors=ANTHROPIC_ERRORS, session_of=no_session, usage_of_body=count_of_body,
    usage_of_stream_tail=usage_of_stream_tail, prefill_only=prefill_only, not_streamed=not_streamed,
)
"""Counting a Messages body's prompt tokens: answered by a replica (the engine's own count), nothing generated."""
