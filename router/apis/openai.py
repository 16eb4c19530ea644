"""OpenAI's chat completions and completions APIs, as the gateway needs to know them: :data:`CHAT` and
:data:`COMPLETIONS`.

- **Prompts** are validated as vLLM validates them (:func:`parse_chat`, :func:`parse_completion`), and a chat's tools
  are dumped as vLLM hands them to the chat template (:func:`engine_tools`).
- **First token.** A chat stream may open with a chunk that carries only ``{"role": "assistant", "content": ""}``.
  Engines that send it before the prefill has run (kvgate's simulator does; vLLM sends it with the first output) make
  the first body byte useless as a time to first token: the gateway would release a request's pending prefill from
  its replica's queue estimate at once (the cost policy then sees a replica busy prefilling a long prompt as idle)
  and feed calibration a "TTFT" of a few milliseconds. So a stream's first output is the first event that is not
  role-only (:func:`holds_output`).
- **Streams** end with ``data: [DONE]``; an error after the first byte is an error event and ``[DONE]``.
- **Usage** is ``usage.prompt_tokens``, ``completion_tokens`` and ``prompt_tokens_details.cached_tokens``, in the
  answer or, streamed, in the last chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from kvgate.router.apis.base import Api, Usage
from kvgate.router.apis.fields import chat_template_of, optional, optional_bool
from kvgate.router.core.errors import OPENAI_ERRORS
from kvgate.router.prompts.conversation import TEXT_PART_FIELDS
from kvgate.router.prompts.prompt import ChatPrompt, CompletionPrompt, PromptError, is_token_id

MAX_HELD_BYTES = 65536
"""Never hold more than this much of a stream back looking for its first output (an odd stream is passed on)."""


MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds", "video_url"}
)
"""Content parts only the engine can turn into tokens (it inserts model-specific placeholder tokens)."""


def parse_completion(body: dict[str, Any]) -> CompletionPrompt:
    """The prompt of a ``/v1/completions`` body: a string, token ids, or a batch of either (first one routed)."""
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    add_special_tokens = optional_bool(body, "add_special_tokens", True)
    prompt = body.get("prompt")
    if prompt is None:
        raise PromptError("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return CompletionPrompt(prompt, None, add_special_tokens, 1)
    if not isinstance(prompt, list) or not prompt:
        raise PromptError("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if all(is_token_id(t) for t in prompt):
        return CompletionPrompt(None, array("I", prompt), add_special_tokens, 1)
    if all(isinstance(p, str) for p in prompt):
        return CompletionPrompt(prompt[0], None, add_special_tokens, len(prompt))
    if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
        return CompletionPrompt(None, array("I", prompt[0]), add_special_tokens, len(prompt))
    raise PromptError(
        "'prompt' must be a string, a list of strings, a list of token ids (integers in [0, 2**32)), "
        "or a list of such lists",
        "prompt",
    )


def parse_chat(body: dict[str, Any]) -> ChatPrompt:
    """The messages and template options of a ``/v1/chat/completions`` body, validated as vLLM validates them."""
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list of messages", "messages")
    has_media = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'", f"messages.{i}")
        has_media |= _check_content(message.get("content"), f"messages.{i}.content")
    add_generation_prompt = optional_bool(body, "add_generation_prompt", True)
    continue_final_message = optional_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise PromptError(
            "cannot set both 'continue_final_message' and 'add_generation_prompt' to true", "continue_final_message"
        )
    kwargs = optional(body, "chat_template_kwargs", dict)
    chat_template = chat_template_of(body, kwargs)
    return ChatPrompt(
        messages=[validated_message(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=optional_bool(body, "add_special_tokens", False),
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        tools=engine_tools(optional(body, "tools", list)),
        documents=optional(body, "documents", list),
        has_media=has_media,
        reasoning_effort=optional(body, "reasoning_effort", str),
    )


def _in_order(value: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``value`` with ``keys`` first, in that order, then its other keys as they came."""
    return {**{k: value[k] for k in keys if k in value}, **{k: v for k, v in value.items() if k not in keys}}


def validated_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message's tool calls as vLLM's request validation hands them on: the openai types' keys in their order
    (``{id, function: {arguments, name}, type}``), other keys after them. A template that dumps a call whole
    (Mistral's ``tool_call.function | tojson``) renders that order; the message is otherwise the client's."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        return message
    ordered = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = _in_order({**call, "function": _in_order(call["function"], FUNCTION_KEYS)}, TOOL_CALL_KEYS)
        ordered.append(call)
    return {**message, "tool_calls": ordered}


TOOL_CALL_KEYS = ("id", "function", "type")
FUNCTION_KEYS = ("arguments", "name")


def _check_content(content: Any, param: str) -> bool:
    """Validates one message's content; True when it holds media parts."""
    if content is None or isinstance(content, str):
        return False
    if not isinstance(content, list):
        raise PromptError("content must be a string, null, or a list of content parts", param)
    has_media = False
    for j, part in enumerate(content):
        if isinstance(part, str):
            continue
        part_type = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part_type, str):
            raise PromptError("a content part must be a string or an object with a string 'type'", f"{param}.{j}")
        if part_type in MEDIA_PART_TYPES:
            has_media = True
        elif part_type == "tool_reference":
            continue
        elif part_type in TEXT_PART_FIELDS:
            text = part.get(TEXT_PART_FIELDS[part_type])  # type: ignore[index]
            if text is not None and not isinstance(text, str):
                raise PromptError(f"'{TEXT_PART_FIELDS[part_type]}' must be a string", f"{param}.{j}")  # type: ignore[index]
        else:
            raise PromptError(f"unsupported content part type {part_type!r}", f"{param}.{j}.type")
    return has_media


def engine_tools(tools: list[Any] | None) -> list[Any] | None:
    """The tools as vLLM hands them to the chat template, so ``tool | tojson`` renders the same text: each one
    validated into its request model and dumped back, so fields in the model's order, ``description`` and
    ``parameters`` always present (null when absent), ``strict`` and ``defer_loading`` only when set (a tool's
    ``defer_loading`` also becomes its function's), unknown fields dropped. A tool vLLM would refuse (the engine
    answers 400) is left as sent."""
    if tools is None:
        return None
    dumped: list[Any] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or tool.get("type", "function") != "function":
            return tools
        defer = tool.get("defer_loading")
        fields = {"name": function["name"], "description": function.get("description"),
                  "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            fields["strict"] = function["strict"]
        function_defer = function.get("defer_loading")
        if function_defer is None:
            function_defer = defer
        if function_defer is not None:
            fields["defer_loading"] = function_defer
        entry: dict[str, Any] = {"type": "function", "function": fields}
        if defer is not None:
            entry["defer_loading"] = defer
        dumped.append(entry)
    return dumped


def max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    return value if isinstance(value, int) else None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _role_only(payload: bytes) -> bool:
    """A chat chunk whose every choice has an empty delta apart from its role, and no finish."""
    try:
        chunk = _chunk_decoder.decode(payload)
    except msgspec.DecodeError:
        return False
    return bool(chunk.choices) and all(
        c.delta is not None and not c.delta.content and not c.delta.reasoning_content and not c.delta.tool_calls
        and c.text is None and c.finish_reason is None
        for c in chunk.choices
    )


def holds_output(buffer: bytes) -> bool:
    """True once ``buffer`` (the start of an SSE stream) has a complete event that is not a role-only chat chunk:
    a token, a finish, an error, ``[DONE]``, or anything this does not understand (never hold an odd stream)."""
    if b'"role"' not in buffer or len(buffer) >= MAX_HELD_BYTES:
        return True
    *complete, _partial = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    for event in complete:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event names, ids
            if not _role_only(line[5:].strip()):
                return True
    return False


def stream_complete(tail: bytes) -> bool:
    return b"[DONE]" in tail


class _UsageDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _UsageDetails | None = None


class _UsageCarrier(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


def usage_of_body(body: bytes) -> Usage | None:
    """``usage`` of an answer read whole (typed decode: other fields are skipped, not built)."""
    try:
        carrier = _usage_decoder.decode(body)
    except msgspec.DecodeError:
        return None
    return _usage(carrier)


def usage_of_stream_tail(tail: bytes) -> Usage | None:
    """``usage`` of the last SSE event that carries one (``stream_options.include_usage``), from the stream's tail."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = _usage(_usage_decoder.decode(line[6:]))
            except msgspec.DecodeError:
                continue
            if usage is not None:
                return usage
    return None


def _usage(carrier: _UsageCarrier) -> Usage | None:
    u = carrier.usage
    if u is None:
        return None
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
    return Usage(u.prompt_tokens, u.completion_tokens, cached)


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """OpenAI's ``prompt_cache_key``: the key a client gives the requests that share a prefix (Codex sends its
    conversation's), used as their session when no session header came."""
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def prefill_only(body: dict[str, Any]) -> dict[str, Any]:
    """Same prompt, one token, not streamed (vLLM's own disaggregation proxy sends its first leg so)."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    leg.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def not_streamed(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg["stream"] = False
    return leg


CHAT = Api(
    name="chat", path="/v1/chat/completions", prompt_param="messages", prompt=parse_chat, max_tokens=max_tokens,
    holds_output=holds_output, stream_complete=stream_complete, errors=OPENAI_ERRORS, session_of=prompt_cache_key,
    usage_of_body=usage_of_body, usage_of_stream_tail=usage_of_stream_tail, prefill_only=prefill_only,
    not_streamed=not_streamed,
)
COMPLETIONS = Api(
    name="completions", path="/v1/completions", prompt_param="prompt", prompt=parse_completion,
    max_tokens=max_tokens, holds_output=holds_output, stream_complete=stream_complete, errors=OPENAI_ERRORS,
    session_of=prompt_cache_key, usage_of_body=usage_of_body, usage_of_stream_tail=usage_of_stream_tail,
    prefill_only=prefill_only, not_streamed=not_streamed,
)
