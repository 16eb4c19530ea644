"""The simulated engine's tokenizer: prompt token ids as vLLM computes them, written for the sim alone.

vLLM encodes a completion prompt with the model's Hugging Face tokenizer (``add_special_tokens`` defaults to true: the
tokenizer's post-processor adds e.g. Llama 3's BOS), and builds a chat prompt in three steps, reproduced here:

1. vLLM's message parsing: text parts joined with ``"\\n"`` for templates that read ``message.content`` as a string,
   kept as ``{"type": "text"}`` parts for templates that loop over the content; tool-call arguments given as JSON text
   parsed to objects; ``None`` content made empty; Claude Code's billing header line cut from system text. When the
   template never names the ``developer`` role, developer messages become system messages and every system message
   is merged into one at the front.
2. transformers' ``apply_chat_template(..., tokenize=False)``: keys whose value is None dropped, reasoning aliased
   under its usual names, the template rendered in a sandboxed jinja2 environment (``trim_blocks``,
   ``lstrip_blocks``, ``loopcontrols``, ``{% generation %}``, ``raise_exception``, ``strftime_now``, an unescaped
   ``tojson``) with ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special-token texts from
   ``tokenizer_config.json`` and the request's ``chat_template_kwargs`` that the template reads;
   ``continue_final_message`` cuts the text after the last message by a tag, as transformers does.
3. The text encoded with ``add_special_tokens`` false by default (the template writes its own BOS).

This module imports nothing from kvgate: the sim is the reference kvgate is tested against, so it must not share the
code under test. The golden tests check both against ``transformers`` itself.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""transformers' ``special_tokens_map`` entries every chat template can read."""

RESERVED_TEMPLATE_ARGUMENTS = frozenset({"messages", "chat_template", "tokenize"})
"""Never taken from ``chat_template_kwargs``."""

CALL_ARGUMENTS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "documents"})
"""``apply_chat_template`` parameters ``chat_template_kwargs`` may set besides the template's own variables."""

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers marks the end of the message to continue with this tag, renders, and cuts the text at the tag."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}
"""OpenAI content parts that carry text, and the field that holds it."""

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's attribution line: its per-request hash would defeat prefix caching, so vLLM cuts it from system
text (``_strip_claude_code_billing_header``)."""


class ChatTemplateError(ValueError):
    """The conversation or options cannot be rendered (the template raised, or a rule of the chat API was broken)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


class ChatTemplate:
    """A compiled chat template, the variables it reads and how it expects message content."""

    def __init__(self, source: str) -> None:
        ast = _ENV.parse(source)
        self.source = source
        self.template = _ENV.from_string(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.loops_over_content = _loops_over_content(ast)


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """True when the template iterates over a message's content (vLLM then hands it OpenAI parts, not a string)."""
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
    return False


class SimTokenizer:
    """A model directory's ``tokenizer.json`` and ``tokenizer_config.json`` (or a bare ``tokenizer.json``)."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        self.chat_template = ChatTemplate(source) if isinstance(source, str) else None
        self.special_ids = frozenset(tokenizer.get_added_tokens_decoder())

    @classmethod
    def from_path(cls, path: str | Path) -> "SimTokenizer":
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        tokenizer = Tokenizer.from_file(str(tok_file))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config_file = tok_file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = tok_file.parent / "chat_template.jinja"
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        return cls(tokenizer, config)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast computes no offsets: the same ids, in less time on long prompts.
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_special_tokens: bool = False,
                    **options: Any) -> list[int]:
        """A chat prompt's token ids; ``options`` are :meth:`render_chat`'s."""
        return self.encode(self.render_chat(messages, **options), add_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat endpoint renders. Raises :class:`ChatTemplateError`."""
        try:
            template = ChatTemplate(chat_template) if chat_template is not None else self.chat_template
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat_template does not parse: {e}") from None
        if template is None:
            raise ChatTemplateError("this model has no chat template; pass chat_template in the request")
        call = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                "tools": tools, "documents": documents}
        extra: dict[str, Any] = {}
        for key, value in (chat_template_kwargs or {}).items():
            if key in CALL_ARGUMENTS:
                call[key] = value
            elif key in template.variables and key not in RESERVED_TEMPLATE_ARGUMENTS:
                extra[key] = value
        if call["add_generation_prompt"] and call["continue_final_message"]:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        chat = [_for_template(m, template.loops_over_content) for m in messages]
        if any(m["role"] == "developer" for m in chat) and not _names_developer(template.source):
            chat = _system_first([{**m, "role": "system"} if m["role"] == "developer" else m for m in chat])
        try:
            return _render(template, chat, call, {**self.special_tokens, **extra})
        except ChatTemplateError:
            raise
        except Exception as e:  # the template's own errors: raise_exception, undefined names, bad types, sandbox
            raise ChatTemplateError(str(e)) from None


def _render(template: ChatTemplate, chat: list[dict[str, Any]], call: dict[str, Any], variables: dict[str, Any]) -> str:
    """transformers' ``render_jinja_template`` for one conversation."""
    continue_final = call["continue_final_message"]
    final: Any = None
    if continue_final:
        if not chat:
            raise ChatTemplateError("continue_final_message is set but the conversation is empty")
        final = chat[-1].get("content")
        if final is None:
            raise ChatTemplateError('continue_final_message is set but the final message has no "content"')
        if "content" not in template.source:
            raise ChatTemplateError("continue_final_message is set but the template never reads content")
        if isinstance(final, list):
            block = next((b for b in reversed(final) if "text" in b), None)
            if block is None:
                raise ChatTemplateError("continue_final_message is set but the final message has no text")
            final = block["text"]
            block["text"] = final + CONTINUE_TAG
        else:
            chat[-1]["content"] = final + CONTINUE_TAG
    rendered = template.template.render(
        **variables, messages=chat, tools=call["tools"], documents=call["documents"],
        add_generation_prompt=call["add_generation_prompt"],
    )
    if not continue_final:
        return rendered
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError("continue_final_message is set but the template dropped part of the final message")
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _for_template(message: dict[str, Any], as_parts: bool) -> dict[str, Any]:
    """One OpenAI message as the template sees it: vLLM's parsing, then transformers' None-dropping and aliasing."""
    role = message.get("role")
    raw = message.get("content")
    parts = [] if raw is None else [raw] if isinstance(raw, str) else raw
    if not isinstance(parts, list):
        raise ChatTemplateError("message content must be a string or a list of parts")
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [t for t in (_part_text(p) for p in parts) if t is not None]
    content: Any = [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = _parsed_tool_calls(message["tool_calls"])
        if message.get("reasoning") is not None:
            out["reasoning"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if as_parts:
            out["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    out = {k: v for k, v in out.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System text parts with Claude Code's billing header line cut off; a part left empty is dropped."""
    out = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _names_developer(source: str) -> bool:
    """vLLM's ``_detect_developer_role_support``: the template text names the role in quotes."""
    return '"developer"' in source or "'developer'" in source


def _system_first(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_consolidate_system_messages``: when a system message is not the only one at the front, every system
    message's text (parts joined with ``"\\n"``, empty ones left out) becomes one system message at the front,
    joined with a blank line."""
    systems = [i for i, m in enumerate(chat) if m["role"] == "system"]
    if not systems or systems == [0]:
        return chat
    texts = []
    for i in systems:
        content = chat[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in chat if m["role"] != "system")]


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
    if field is None:
        raise ChatTemplateError(f"content part {kind!r} cannot be rendered as text")
    text = part.get(field)
    if text is not None and not isinstance(text, str):
        raise ChatTemplateError(f"content part field {field!r} must be a string")
    return text


def _parsed_tool_calls(calls: Any) -> Any:
    """vLLM hands templates tool-call arguments as objects: JSON text is parsed (``{}`` when it does not parse)."""
    if not isinstance(calls, list):
        return calls
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            parsed.append(call)
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed or None


def _token_text(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value
