"""Chat templates as transformers 5 compiles and applies them and vLLM 0.32 feeds them: compiled in jinja2's
sandbox, what vLLM reads from a template's text before rendering it, and rendering one chat.

:func:`render_chat` is vLLM's ``parse_chat_messages`` and ``safe_apply_chat_template`` (``vllm/renderers/hf.py``
L780-842) around transformers' ``apply_chat_template(tokenize=False)`` (``transformers/tokenization_utils_base.py``
L2990-3164, ``transformers/utils/chat_template_utils.py`` L425-614). Which template a request renders with, and with
which messages and kwargs, is :mod:`kvgate.router.prompts.model_templates`' business.

The simulated fleet has its own implementation (``loadgen/sim/tokenizer.py``); golden tests hold both to
``transformers``' own ``apply_chat_template`` and kvgate's to vLLM's own rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from jinja2.runtime import Macro

from kvgate.router.prompts.content_format import ContentFormat, ContentFormatOption, detect_content_format
from kvgate.router.prompts.conversation import conversation_for_template, developer_as_system, supports_developer_role
from kvgate.router.prompts.template_kwargs import accepted_kwargs

CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What transformers appends to the final message for ``continue_final_message``, to cut the rendered text at."""

SHADOWED_ARGUMENTS = frozenset({"self", "conversation", "conversations", "messages"})
"""Kwargs that collide with an argument transformers passes itself: vLLM lets them through when the template reads
them, and the call then fails (a ``TypeError``, which vLLM answers with a 400)."""

UNUSED_WHEN_NOT_TOKENIZING = (
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
)
"""``apply_chat_template`` parameters that only shape its tokenizer call: they change nothing in the text."""

INLINE_SYSTEM_PROBE = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]
"""The conversation vLLM renders to learn whether a template takes a system message after the first."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template compiled as transformers compiles it, with what vLLM reads from its text before it renders."""

    source: str
    template: jinja2.Template
    special_tokens: dict[str, str]
    """The model's special tokens (:func:`kvgate.router.prompts.special_tokens.special_tokens`), template
    variables unless a kwarg of the same name replaces one."""
    variables: frozenset[str]
    """Undeclared variables the template reads: with ``apply_chat_template``'s parameters, the only kwargs that
    reach it (vLLM's rule)."""
    detected_format: ContentFormat
    """The content format ``auto`` resolves to for this template."""
    supports_developer: bool
    """Whether developer messages reach it as they are (else they become system messages)."""


def merges_inline_system(source: str | None) -> bool:
    """Whether a template fails on a system message after the first, as vLLM probes it
    (``AnthropicServingMessages._detect_merge_inline_system``, entrypoints/anthropic/serving.py L272-299):
    ``[system, user, system, user]`` rendered in a bare sandbox (no ``raise_exception``, ``strftime_now``, ``tojson``
    override, ``generation`` tag, special tokens or tools), where any template error, one that does not parse, and
    no template at all mean yes. An error of another kind propagates: vLLM does not start with such a template
    either."""
    if not source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        env.from_string(source).render(messages=INLINE_SYSTEM_PROBE, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


class GenerationTag(jinja2.ext.Extension):
    """Transformers' ``{% generation %}...{% endgeneration %}`` (its ``AssistantTracker``), which marks the
    assistant's tokens for training masks: when rendering a prompt it renders its body, nothing more."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return caller()


def compile_chat_template(source: str, special_tokens: dict[str, str]) -> ChatTemplate:
    """Compile a chat template the way transformers does (sandboxed, trim_blocks/lstrip_blocks, its ``tojson``,
    ``raise_exception`` and ``strftime_now``, the ``generation`` tag).

    Raises ``jinja2.TemplateSyntaxError`` for a template that does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    ast = env.parse(source)
    return ChatTemplate(
        source=source,
        template=env.from_string(source),
        special_tokens=special_tokens,
        variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
        detected_format=detect_content_format(ast),
        supports_developer=supports_developer_role(source),
    )


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
    # Transformers' tojson: no HTML escaping (jinja's default tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(
    template: ChatTemplate, messages: Sequence[dict[str, Any]], kwargs: dict[str, Any],
    content_format: ContentFormatOption,
) -> str:
    """The prompt text vLLM renders with ``template`` for these OpenAI messages and ``kwargs`` (everything it
    hands ``safe_apply_chat_template``: :func:`kvgate.router.prompts.template_kwargs.template_kwargs`), with the
    content in ``content_format`` (``auto``: the template's own).

    Developer messages become system messages for a template that does not name the role. Raises ``ValueError``,
    ``TypeError`` or ``jinja2.TemplateError`` where vLLM or the template refuses the chat.
    """
    conversation = conversation_for_template(
        messages, template.detected_format if content_format == "auto" else content_format
    )
    if not template.supports_developer and any(message["role"] == "developer" for message in conversation):
        conversation = developer_as_system(conversation)
    tools = kwargs.get("tools")
    variables = accepted_kwargs({k: v for k, v in kwargs.items() if k != "tools"}, template.variables)
    return _apply(template, conversation, tools, variables)


def _apply(
    template: ChatTemplate, conversation: list[dict[str, Any]], tools: Any, variables: dict[str, Any]
) -> str:
    """Transformers' ``apply_chat_template(conversation, tools=tools, tokenize=False, **variables)``: its own
    parameters taken out, the rest over the special tokens as the template's variables."""
    shadowed = SHADOWED_ARGUMENTS & variables.keys()
    if shadowed:
        raise TypeError(f"chat_template_kwargs {sorted(shadowed)} collide with the chat template's own arguments")
    add_generation_prompt = variables.pop("add_generation_prompt", False)
    continue_final_message = variables.pop("continue_final_message", False)
    documents = variables.pop("documents", None)
    if variables.pop("return_assistant_tokens_mask", False):
        raise ValueError("`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`")
    for name in UNUSED_WHEN_NOT_TOKENIZING:
        variables.pop(name, None)
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("Tools should either be a JSON schema, or a callable function")
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat, final = conversation, None
    if continue_final_message:
        chat, final = _tagged_final_message(template.source, conversation)
    rendered = template.template.render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
        **{**template.special_tokens, **variables},
    )
    if final is None:
        return rendered
    return _cut_at_tag(rendered, final)


def _tagged_final_message(source: str, conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``continue_final_message``: the conversation with :data:`CONTINUE_FINAL_MESSAGE_TAG` after the final
    message's text (its last text part's), and that text (transformers' ``render_jinja_template``)."""
    last = conversation[-1]
    content = last.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in source:
        raise ValueError(
            'continue_final_message is set to "content" but this is not an accepted field in the chat_template'
        )
    if isinstance(content, (list, tuple)):
        for i in reversed(range(len(content))):
            if "text" in content[i]:
                final = content[i]["text"]
                parts = [*content[:i], {**content[i], "text": final + CONTINUE_FINAL_MESSAGE_TAG}, *content[i + 1:]]
                return [*conversation[:-1], {**last, "content": parts}], final
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the final message!"
        )
    return [*conversation[:-1], {**last, "content": content + CONTINUE_FINAL_MESSAGE_TAG}], content


def _cut_at_tag(rendered: str, final: str) -> str:
    """The rendered text up to the tag: the model continues the final message instead of starting a new turn."""
    tag = CONTINUE_FINAL_MESSAGE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            "chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_FINAL_MESSAGE_TAG)] == CONTINUE_FINAL_MESSAGE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the text's trailing space, and the tag's with it
