"""OpenAI's Responses API (Codex's, the Agents SDK's), as vLLM serves it and the gateway needs to know it:
:data:`RESPONSES`.

- **Prompts.** vLLM turns ``instructions`` and ``input`` into a chat conversation (``construct_input_messages`` in
  ``vllm/entrypoints/openai/responses/utils.py``) and renders it with the model's chat template;
  :func:`conversation` is the same conversion. Items that belong to one assistant turn merge into one message
  (reasoning, its text, its function calls); a ``function_call_output`` is a ``tool`` message; an assistant message
  keeps only its first content part; other role-bearing items pass as chat messages. The prompt is tokenized with
  ``add_special_tokens`` (chat and Messages are not).
- **A stored response's follow-up** (``previous_response_id``) is rendered after what vLLM stored of the one before:
  its conversation without system messages, then its output messages' texts (:class:`History`). The conversation
  lives in the engine process that answered, so the follow-up must go to that replica.
- **Streams** are named events with no ``[DONE]``: ``response.created`` and ``response.in_progress`` come before any
  output, ``response.completed`` ends the stream and carries the usage.
- **Usage.** ``input_tokens`` is the whole prompt, cached tokens included (``input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvgate.router.apis.base import Api, Usage
from kvgate.router.apis.fields import chat_template_of, one_of, optional
from kvgate.router.apis.openai import MAX_HELD_BYTES, MEDIA_PART_TYPES, engine_tools, prompt_cache_key
from kvgate.router.apis.sse import complete_events, event
from kvgate.router.core.errors import OPENAI_ERRORS, ApiError, ErrorShape
from kvgate.router.prompts.prompt import ChatPrompt, PromptError

CUSTOM_TOOL_INPUT_KEY = "input"
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        CUSTOM_TOOL_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."},
    },
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}
"""The single-string function a ``custom`` tool is shown to the model as (vLLM's ``custom_tool_parameters``)."""
NAMESPACE_SEPARATOR = "__"
PARTIAL_STATUSES = frozenset({"in_progress", "incomplete"})
"""A last assistant item in one of these is continued, not answered (vLLM's ``should_continue_final_message``)."""


@dataclass(frozen=True, slots=True)
class History:
    """What vLLM stored of a response, as a follow-up naming it is rendered after: its conversation (the one it was
    rendered from) and the texts of its output messages, one per content part."""

    messages: list[dict[str, Any]]
    output_texts: list[str]


# --- input items, as vLLM's request model classifies and converts them ------------------------------------------


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise PromptError("a string is required", param)
    return value


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A ``function_call`` item's tool call; its fields as vLLM's ``ResponseFunctionToolCall`` requires them."""
    for name in ("arguments", "call_id", "name"):
        _text(item.get(name), f"{param}.{name}")
    name = item["name"]
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item["call_id"], "function": {"name": name, "arguments": item["arguments"]}, "type": "function"}


def _custom_tool_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name = _text(item.get("call_id"), f"{param}.call_id"), _text(item.get("name"), f"{param}.name")
    arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its first content part's, else its first summary's (``summary`` is required)."""
    summary = item.get("summary")
    if not isinstance(summary, list):
        raise PromptError("a reasoning item needs a 'summary' list", f"{param}.summary")
    if item.get("encrypted_content"):
        raise PromptError("Encrypted content is not supported.", "input")
    content = item.get("content")
    parts = content if isinstance(content, list) and content else summary
    if not parts:
        return ""
    first = parts[0]
    return _text(first.get("text") if isinstance(first, dict) else None, f"{param}.content.0.text")


def _output_message_text(item: dict[str, Any], param: str) -> str:
    """An assistant output message's first content part's text (vLLM keeps only that one)."""
    content = item["content"]
    if not content or not all(isinstance(part, dict) for part in content):
        raise PromptError("an assistant message's content must be a non-empty list of parts", f"{param}.content")
    first = content[0]
    if first.get("type") != "output_text":
        raise PromptError("an assistant message's first part must be output_text", f"{param}.content.0.type")
    return _text(first.get("text"), f"{param}.content.0.text")


def _assistant(previous: dict[str, Any] | None) -> dict[str, Any] | None:
    return previous if previous is not None and previous.get("role") == "assistant" else None


def _merge_or_new(out: list[dict[str, Any]], key: str, value: Any) -> None:
    """Put ``value`` under ``key`` in the last message when that is an assistant message without one; else append a
    new assistant message with it."""
    last = _assistant(out[-1] if out else None)
    if last is not None and last.get(key) is None:
        last[key] = value
    else:
        out.append({"role": "assistant", key: value})


def _item(item: Any, index: int, out: list[dict[str, Any]]) -> None:
    param = f"input.{index}"
    if not isinstance(item, dict):
        raise PromptError("an input item must be an object", param)
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _function_call(item, param) if kind == "function_call" else _custom_tool_call(item, param)
        last = _assistant(out[-1] if out else None)
        if last is not None and isinstance(last.get("tool_calls"), list):
            last["tool_calls"].append(call)
        elif last is not None and last.get("tool_calls") is None:
            last["tool_calls"] = [call]
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "reasoning":
        _merge_or_new(out, "reasoning", _reasoning(item, param))
    elif kind == "message" and item.get("role") == "assistant" and isinstance(item.get("content"), list):
        _merge_or_new(out, "content", _output_message_text(item, param))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif item.get("role") == "assistant" and _assistant_text(item) is not None:
        _merge_or_new(out, "content", _assistant_text(item))
    elif "role" in item:
        _check_message(item, param)
        out.append(dict(item))  # a later item may merge into it: the request's own body stays as sent
    else:
        raise PromptError(f"Unsupported input item type: {kind}", "input")


def _assistant_text(item: dict[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _check_message(item: dict[str, Any], param: str) -> None:
    if item.get("role") not in ("user", "system", "developer", "assistant"):
        raise PromptError("a message's role must be user, system, developer or assistant", f"{param}.role")
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise PromptError("a message's content must be a string or a list of parts", f"{param}.content")


def conversation(body: dict[str, Any], history: History | None = None) -> list[dict[str, Any]]:
    """The chat vLLM renders for a Responses body (after ``history``, a stored response's, for a follow-up)."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        out.append({"role": "system", "content": _text(instructions, "instructions")})
    if history is not None:
        out += [dict(m) for m in history.messages if m.get("role") != "system"]
        out += [{"role": "assistant", "content": text} for text in history.output_texts]
    items = body.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    if not isinstance(items, list):
        raise PromptError("'input' must be a string or a list of items", "input")
    converted: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _item(item, index, converted)
    return out + converted


def continues_final_message(body: dict[str, Any]) -> bool:
    """Whether the last input item is an assistant message or reasoning still in progress, to be continued."""
    items = body.get("input")
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and one_of(last.get("status"), PARTIAL_STATUSES)


def _function_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The function tools the model is shown, in request order: namespaces flattened to ``<namespace>__<name>``,
    custom tools as a one-string function, other tool types (web search, MCP, …) left out."""
    shown: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise PromptError("a tool must be an object", f"tools.{i}")
        kind = tool.get("type")
        if kind == "function":
            shown.append(_function(tool, f"tools.{i}"))
        elif kind == "namespace":
            namespace = _text(tool.get("name"), f"tools.{i}.name")
            for j, inner in enumerate(tool.get("tools") or []):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    function = _function(inner, f"tools.{i}.tools.{j}")
                    shown.append({**function, "name": f"{namespace}{NAMESPACE_SEPARATOR}{function['name']}"})
        elif kind == "custom":
            shown.append({"name": _text(tool.get("name"), f"tools.{i}.name"), "description": tool.get("description"),
                          "parameters": CUSTOM_TOOL_PARAMETERS})
    return shown


def _function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    _text(tool.get("name"), f"{param}.name")
    optional(tool, "parameters", dict, f"{param}.parameters")
    return {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters"),
            "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}


def engine_tools_of(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools as vLLM hands them to the chat template (none when the request has none)."""
    tools = optional(body, "tools", list)
    if not tools:
        return None
    return engine_tools([{"type": "function", "function": f} for f in _function_tools(tools)])


def responses_prompt(body: dict[str, Any], history: History | None = None) -> ChatPrompt:
    """The prompt of a ``/v1/responses`` body (after ``history`` for a follow-up of a stored response)."""
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    if body.get("prompt") is not None:
        raise PromptError("prompt template is not supported", "prompt")
    messages = conversation(body, history)
    reasoning = optional(body, "reasoning", dict)
    kwargs = optional(body, "chat_template_kwargs", dict)
    continues = continues_final_message(body)
    has_media = any(isinstance(part, dict) and one_of(part.get("type"), MEDIA_PART_TYPES)
                    for m in messages if isinstance(m.get("content"), list) for part in m["content"])
    return ChatPrompt(
        messages=messages,
        add_generation_prompt=not continues,
        continue_final_message=continues,
        add_special_tokens=True,
        chat_template=chat_template_of({}, kwargs),
        chat_template_kwargs=kwargs,
        tools=engine_tools_of(body),
        documents=None,
        has_media=has_media,
        reasoning_effort=reasoning.get("effort") if reasoning is not None else None,
    )


def parse_responses(body: dict[str, Any]) -> ChatPrompt:
    return responses_prompt(body)


def previous_response_id(body: dict[str, Any]) -> str | None:
    value = body.get("previous_response_id")
    if value is not None and not isinstance(value, str):
        raise PromptError("'previous_response_id' must be a string", "previous_response_id")
    return value or None


def history_of(messages: list[dict[str, Any]], response: bytes) -> History | None:
    """What a follow-up of this answered response is rendered after: the conversation it was rendered from, and the
    texts of its output's message items (None when ``response`` is not a response object)."""
    try:
        decoded = msgspec.json.decode(response)
    except msgspec.DecodeError:
        return None
    output = decoded.get("output") if isinstance(decoded, dict) else None
    if not isinstance(output, list):
        return None
    texts = [part.get("text", "") for item in output if isinstance(item, dict) and item.get("type") == "message"
             for part in item.get("content") or [] if isinstance(part, dict)]
    return History(messages, [t for t in texts if isinstance(t, str)])


# --- answers ---------------------------------------------------------------------------------------------------------


def max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_output_tokens")
    return value if type(value) is int else None


PREAMBLE_EVENTS = frozenset({b"response.created", b"response.in_progress", b"response.queued"})
END_EVENTS = (b"response.completed", b"response.incomplete", b"response.failed")


def holds_output(buffer: bytes) -> bool:
    """True once the stream's start has a complete event other than the response's creation and progress."""
    if len(buffer) >= MAX_HELD_BYTES:
        return True
    return any(name not in PREAMBLE_EVENTS for name, _ in complete_events(buffer))


def stream_complete(tail: bytes) -> bool:
    """Whether the stream's end event is in its tail: its data ends with its ``"type"``, so even an end event longer
    than the tail shows it."""
    return any(end in tail for end in END_EVENTS)


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _ResponsesUsage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None

    def counts(self) -> Usage:
        cached = self.input_tokens_details.cached_tokens if self.input_tokens_details is not None else None
        return Usage(self.input_tokens, self.output_tokens, cached)


class _Response(msgspec.Struct):
    usage: _ResponsesUsage | None = None


class _Completed(msgspec.Struct):
    response: _Response | None = None


_response_decoder = msgspec.json.Decoder(_Response)
_completed_decoder = msgspec.json.Decoder(_Completed)
_usage_decoder = msgspec.json.Decoder(_ResponsesUsage)
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')


def usage_of_body(body: bytes) -> Usage | None:
    try:
        usage = _response_decoder.decode(body).usage
    except msgspec.DecodeError:
        return None
    return usage.counts() if usage is not None else None


def usage_of_stream_tail(tail: bytes) -> Usage | None:
    """``response.completed``'s usage. That event carries the whole response, which can be longer than the tail: then
    the usage object (the response's last field, no strings inside) is cut out of what is there."""
    for name, data in reversed(list(complete_events(tail, tail=True))):
        # The tail may begin inside the completed event: then it has no name, but its data still ends with its type.
        if name not in END_EVENTS and not (name == b"" and any(end in data[-80:] for end in END_EVENTS)):
            continue
        try:
            completed = _completed_decoder.decode(data)
        except msgspec.DecodeError:
            return _usage_in(data)
        usage = completed.response.usage if completed.response is not None else None
        return usage.counts() if usage is not None else None
    return None


def _usage_in(data: bytes) -> Usage | None:
    found = list(_USAGE_KEY.finditer(data))
    if not found:
        return None
    start = found[-1].end() - 1
    depth = 0
    for end in range(start, len(data)):
        depth += {ord("{"): 1, ord("}"): -1}.get(data[end], 0)
        if depth == 0:
            try:
                return _usage_decoder.decode(data[start : end + 1]).counts()
            except msgspec.DecodeError:
                return None
    return None


def prefill_only(body: dict[str, Any]) -> dict[str, Any]:
    """Same prompt, one token, not streamed, not stored (a transfer's first leg)."""
    return {**body, "stream": False, "max_output_tokens": 1, "store": False}


def not_streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": False}


def _stream_error(err: ApiError) -> bytes:
    """OpenAI's Responses error event."""
    return event("error", msgspec.json.encode({"type": "error", "code": err.code, "message": err.message,
                                                "param": err.param}))


RESPONSES_ERRORS = ErrorShape(body=ApiError.encoded, stream_events=_stream_error, from_engine=OPENAI_ERRORS.from_engine)

RESPONSES = Api(
    name="responses", path="/v1/responses", prompt_param="input", prompt=parse_responses, max_tokens=max_tokens,
    holds_output=holds_output, stream_complete=stream_complete, errors=RESPONSES_ERRORS, session_of=prompt_cache_key,
    usage_of_body=usage_of_body, usage_of_stream_tail=usage_of_stream_tail, prefill_only=prefill_only,
    not_streamed=not_streamed,
)
