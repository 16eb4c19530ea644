"""The conversation a chat template sees: OpenAI chat messages rebuilt the way vLLM 0.32 rebuilds them before it
applies the template (``vllm/renderers/chat_utils.py``: ``_parse_chat_message_content`` L2074-2150, the content
parts L1846-2040, ``_postprocess_messages`` L2153-2227; ``vllm/renderers/hf.py``: the developer role L511-564).

Only text is rebuilt here: a prompt with media parts is tokenized by the engine itself.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from kvgate.router.prompts.content_format import ContentFormat

TEXT_PART_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part types that carry text, and the field holding it (as vLLM's chat parser reads them)."""

SKIPPED_WHEN_EMPTY = frozenset({"text", "refusal"})
"""Text part types vLLM drops when their text is null (``PART_TYPES_TO_SKIP_NONE_CONTENT``)."""

KNOWN_PART_FIELDS = frozenset(
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
     "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"}
)
"""Every field of vLLM's content part types (``_KNOWN_CONTENT_PART_FIELDS``): any other field of a text part (a
``cache_control``, say) is kept on the part a template that loops over parts sees."""

MEDIA_PART_KEYS = frozenset(
    {"image_url", "input_image", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil",
     "audio_url", "input_audio", "video_url"}
)
"""Keys that make an untyped part a media part for vLLM; such a part is the engine's to turn into tokens."""

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's attribution line: vLLM cuts it from every system message (its value changes per request)."""


def conversation_for_template(
    messages: Sequence[dict[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """OpenAI chat messages as vLLM hands them to a chat template.

    Each message becomes a new one with ``role`` and ``content``: one string with the text parts joined by ``"\\n"``
    (``None`` content is ``""``) for ``string`` templates, the list of ``{"type": "text", "text": ...}`` parts (a
    string content is one part) for ``openai`` ones, except that a tool message of text parts is one string either
    way. Then, kept when present: an assistant's ``tool_calls`` (their ``arguments`` parsed to an object: ``{}``
    for anything but a JSON object, an empty list dropped) and ``reasoning`` (also as ``reasoning_content``), a tool
    message's ``tool_call_id``, a string ``name`` and ``task``, a developer message's ``tools``. Every other key is
    dropped, and a system message loses a leading billing-header line.

    Raises ``ValueError`` for what vLLM refuses or this text-only path cannot render (media, unknown part types).
    """
    conversation = [_message(message, content_format) for message in messages]
    for message in conversation:
        if message["role"] == "assistant" and "tool_calls" in message:
            if message["tool_calls"]:
                message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
            else:  # templates then take the plain assistant path
                del message["tool_calls"]
    return conversation


def _message(message: dict[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role == "system":
        parts = _without_billing_header(parts)
    wrapped = content_format == "openai"
    kept = [part for part in (_part(p, wrapped) for p in parts) if part is not None]
    converted: dict[str, Any] = {"role": role, "content": kept if wrapped else "\n".join(kept)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            if not isinstance(message["tool_calls"], list):
                raise ValueError("an assistant message's tool_calls must be a list")
            converted["tool_calls"] = list(message["tool_calls"])
        if message.get("reasoning") is not None:
            converted["reasoning"] = converted["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            converted["tool_call_id"] = message["tool_call_id"]
        if wrapped and not any(isinstance(p, dict) and p.get("type") != "text" for p in kept):
            converted["content"] = "\n".join(p.get("text", "") for p in kept if isinstance(p, dict))
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            converted[key] = message[key]
    if role == "developer":
        converted["tools"] = message.get("tools")
    return converted


def _part(part: Any, wrapped: bool) -> Any:
    """One content part as the template sees it: its text (``wrapped``: a ``{"type": "text"}`` part with the
    part's other fields), or None for a ``text`` or ``refusal`` part without text, which vLLM skips."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrapped else part
    if not isinstance(part, dict):
        raise ValueError("a content part must be a string or an object")
    part_type = part.get("type")
    if part_type is None or part.get("uuid") is not None:
        if any(key in part for key in MEDIA_PART_KEYS):
            raise ValueError("a media content part cannot be rendered as text")
        raise ValueError("a content part has no 'type'")
    if not isinstance(part_type, str):
        raise ValueError("a content part's 'type' must be a string")
    if part_type in TEXT_PART_FIELDS:
        text = part.get(TEXT_PART_FIELDS[part_type])
        if text is None and part_type in SKIPPED_WHEN_EMPTY:
            return None
        if not wrapped:
            return _text(text)
        return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}}
    if part_type == "tool_reference":  # a deferred tool, expanded by the template itself
        return {"type": "tool_reference", "name": part.get("name")} if wrapped else _text(part.get("name"))
    raise ValueError(f"content part type {part_type!r} cannot be rendered as text")


def _text(value: Any) -> str:
    """A part's text where vLLM joins the texts into one string (and fails on anything else)."""
    if not isinstance(value, str):
        raise ValueError("a content part has no text to join")
    return value


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System text parts without Claude Code's leading billing-header line (``_strip_claude_code_billing_header``,
    chat_utils L2045-2071); a part that was only that line is dropped."""
    kept = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if _is_text_part(part) else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"


def _with_parsed_arguments(call: Any) -> dict[str, Any]:
    """A tool call whose ``function.arguments`` is the object the JSON text holds: ``{}`` when it is empty, not JSON
    or not an object (vLLM logs and carries on, so one bad call in the history does not fail every later turn)."""
    if not isinstance(call, dict):
        raise ValueError("assistant tool_calls entries must be objects")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ValueError("chat completions only support assistant tool_calls of type 'function'")
    arguments = function.get("arguments")
    parsed: Any = {}
    if arguments:
        parsed = arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


def supports_developer_role(source: str) -> bool:
    """Whether a template takes developer messages, as vLLM decides it: its text names the role in quotes
    (``_detect_developer_role_support``, hf.py L511-513)."""
    return '"developer"' in source or "'developer'" in source


def developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with developer messages, for a template that does not take them: each becomes a system message
    (without its ``tools``), and then, when any system message is not first or there are several, all of them are
    merged into one at the front, their texts joined with ``"\\n\\n"`` (``_convert_developer_to_system`` and
    ``_consolidate_system_messages``, hf.py L516-564)."""
    converted = [
        {key: value for key, value in {**message, "role": "system"}.items() if key != "tools"}
        if message["role"] == "developer" else message
        for message in conversation
    ]
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    scattered = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        scattered = scattered or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            texts.append(content)
    if not scattered:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
