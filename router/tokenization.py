"""Exact token ids as the engine computes them: the model's tokenizer.json and its chat template.

This module holds the per-model tokenizer (:class:`ModelTokenizer`). The router's prompt tokenization path (caching,
running off the event loop, /tokenize fallback, approximate mode) builds on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    template: jinja2.Template
    special_tokens: dict[str, Any]

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )


def _compile_chat_template(source: str, special_tokens: dict[str, Any]) -> ChatTemplate:
    # Hugging Face renders chat templates in a sandboxed environment with trim_blocks/lstrip_blocks; so does vLLM.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return ChatTemplate(source, env.from_string(source), special_tokens)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


class ModelTokenizer:
    """One model's tokenizer and chat template, loaded from a local model directory or a tokenizer.json path."""

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None, add_bos: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._bos_id = tokenizer.token_to_id(add_bos) if add_bos else None

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelTokenizer":
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        config_file = tok_file.parent / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(str(tok_file))
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_source = config.get("chat_template")
        if isinstance(template_source, list):  # HF allows [{"name": "default", "template": ...}, ...]
            template_source = next((t["template"] for t in template_source if t.get("name") == "default"), None)
        chat_template_file = tok_file.parent / "chat_template.jinja"
        if template_source is None and chat_template_file.exists():
            template_source = chat_template_file.read_text()
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = _compile_chat_template(template_source, special) if template_source else None
        add_bos = special["bos_token"] if config.get("add_bos_token") else None
        return cls(tokenizer, template, add_bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, as vLLM encodes it (special tokens in the text are parsed as such)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt: template rendered, then encoded without adding special tokens (vLLM's chat
        default), since the template writes them itself."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": "...", ...}
        return value.get("content")
    return value
