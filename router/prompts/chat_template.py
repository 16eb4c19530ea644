"""Chat templates as Hugging Face and vLLM apply them: compiled in jinja2's sandbox, OpenAI messages converted the way
vLLM converts them for a template, and rendered.

The simulated fleet has its own implementation (``loadgen/sim/tokenizer.py``); golden tests hold both to
``transformers``' own ``apply_chat_template``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]
"""How a template expects ``message.content``: one string (text parts joined), or the list of OpenAI parts."""

TEXT_PART_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part types that carry text, and the field holding it (as vLLM's chat parser reads them)."""

TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
"""Template variables kvgate sets itself; ``chat_template_kwargs`` cannot override them."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    template: jinja2.Template
    special_tokens: dict[str, Any]
    content_format: ContentFormat
    variables: frozenset[str]
    """Undeclared variables the template reads: the only ``chat_template_kwargs`` that reach it (vLLM's rule)."""

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )


def compile_chat_template(source: str, special_tokens: dict[str, Any]) -> ChatTemplate:
    """Compile a chat template the way Hugging Face does (sandboxed, trim_blocks/lstrip_blocks; vLLM too).

    Raises ``jinja2.TemplateSyntaxError`` for a template that does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    ast = env.parse(source)
    variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
    return ChatTemplate(source, env.from_string(source), special_tokens, _content_format(ast), variables)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja's default tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """``openai`` when the template loops over a message's content (it expects parts), else ``string``.

    vLLM resolves ``--chat-template-content-format auto`` the same way: by looking for such a loop in the AST.
    """
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) and it.arg.value == "content":
            return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def conversation_for_template(messages: Sequence[dict[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """OpenAI chat messages as vLLM hands them to a chat template.

    Text parts are joined with ``"\\n"`` for string-content templates or kept as ``{"type": "text"}`` parts for
    templates that loop over parts; ``None`` content becomes empty; assistant tool-call arguments given as JSON
    strings are parsed to dicts (``{}`` when not valid JSON); ``name``, ``tool_call_id`` and ``reasoning`` are kept.
    Raises ``ValueError`` for content this text-only path cannot render (media parts, unknown part types).
    """
    conversation = []
    for message in messages:
        role = message["role"]
        parts = message.get("content")
        if parts is None:
            parts = []
        elif isinstance(parts, str):
            parts = [parts]
        texts = [_part_text(part) for part in parts]
        texts = [t for t in texts if t is not None]
        content: str | list[dict[str, str]]
        if content_format == "openai":
            content = [{"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(texts)
        converted: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                converted["tool_calls"] = _tool_calls_for_template(message["tool_calls"])
            if message.get("reasoning") is not None:
                converted["reasoning"] = converted["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                converted["tool_call_id"] = message["tool_call_id"]
            if isinstance(content, list):
                converted["content"] = "\n".join(p["text"] for p in content)
        if isinstance(message.get("name"), str):
            converted["name"] = message["name"]
        if role == "developer":
            converted["tools"] = message.get("tools")
        conversation.append(converted)
    return conversation


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ValueError("a content part must be a string or an object")
    part_type = part.get("type")
    field = TEXT_PART_FIELDS.get(part_type) if isinstance(part_type, str) else None
    if field is None:
        raise ValueError(f"content part type {part_type!r} cannot be rendered as text")
    text = part.get(field)
    if text is not None and not isinstance(text, str):
        raise ValueError(f"content part field {field!r} must be a string")
    return text


def _tool_calls_for_template(tool_calls: Any) -> Any:
    if not isinstance(tool_calls, list):
        return tool_calls
    if not tool_calls:
        return None
    converted = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            converted.append(call)
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return converted


def cut_after_final_message(rendered: str, final_content: Any) -> str:
    """``continue_final_message``: drop what the template wrote after the last message's text (Hugging Face's rule),
    so the model continues that message instead of starting a new turn."""
    final = final_content
    if isinstance(final, list):
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat")
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def render_chat(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    tools: list[Any] | None = None,
    documents: list[Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text vLLM's chat endpoint builds with ``template`` for these OpenAI messages and options.

    Raises ``ValueError`` / ``jinja2.TemplateError`` for messages or options the template rejects.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("cannot set both continue_final_message and add_generation_prompt")
    conversation = conversation_for_template(messages, template.content_format)
    extra = {
        k: v for k, v in (chat_template_kwargs or {}).items() if k in template.variables and k not in TEMPLATE_ARGUMENTS
    }
    rendered = template.render(
        conversation,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        documents=documents,
        continue_final_message=continue_final_message,
        **extra,
    )
    if continue_final_message and conversation:
        rendered = cut_after_final_message(rendered, conversation[-1]["content"])
    return rendered


