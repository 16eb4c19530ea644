"""Exact token ids as the engine computes them: the model's tokenizer.json, its special tokens and its chat templates.

:class:`ModelTokenizer` is one model's: loaded from a local model directory, it renders chats with the model's
templates (:mod:`kvgate.router.prompts.model_templates`) and encodes with the tokenizers library as transformers and
vLLM do. The gateway's prompt path (:mod:`kvgate.router.prompts.tokenizer`) adds caching, runs it off the event loop
and falls back to ``/tokenize`` or an approximation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from kvgate.router.prompts.model_templates import ModelTemplates, TemplateSettings
from kvgate.router.prompts.prompt import ChatPrompt
from kvgate.router.prompts.special_tokens import special_tokens
from kvgate.router.prompts.template_choice import tokenizer_templates


class ModelTokenizer:
    """One model's tokenizer and chat templates, loaded from a local model directory or a tokenizer.json path."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: ModelTemplates,
        wrap: tuple[list[int], list[int]] = ([], []),
    ):
        self.tokenizer = tokenizer
        self.templates = templates
        self.prefix_ids, self.suffix_ids = wrap
        """Special tokens put before / after a prompt encoded with ``add_special_tokens`` (e.g. BOS)."""
        self.max_chars_per_token = _max_chars_per_token(tokenizer)
        """The most characters of prompt text one token can stand for: a prompt of ``c`` characters has at least
        ``c / max_chars_per_token`` tokens."""

    @classmethod
    def from_path(cls, path: str | Path, settings: TemplateSettings = TemplateSettings()) -> "ModelTokenizer":
        """The tokenizer of a model directory (or of a tokenizer.json, its tokenizer_config.json beside it), with
        the operator's template ``settings``."""
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        config_file = tok_file.parent / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(str(tok_file))
        # Transformers' tokenizer call ignores a tokenizer.json's own truncation/padding unless asked; so does vLLM.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        special = special_tokens(config)
        templates = ModelTemplates(tokenizer_templates(tok_file.parent, config), settings, special)
        return cls(tokenizer, templates, _special_token_wrap(tokenizer))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, as vLLM encodes it (special tokens in the text are parsed as such)."""
        # encode_batch releases the GIL (encode does not), so other threads and the event loop keep running.
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.prefix_ids + ids + self.suffix_ids if add_special_tokens else ids

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat endpoint builds for these OpenAI messages and options, rendered here even
        with a ``chat_template`` of the caller's (the gateway renders a request's own in the sandboxed child).

        Raises ``ValueError`` / ``TypeError`` / ``jinja2.TemplateError`` for messages or options the template
        rejects.
        """
        prompt = ChatPrompt(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, add_special_tokens=False, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs, tools=tools, documents=documents, has_media=False,
        )
        return self.templates.render(prompt)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **options: Any,
    ) -> list[int]:
        """Token ids of a chat prompt: template rendered, then encoded without adding special tokens (vLLM's chat
        default), since the template writes them itself. ``options`` are :meth:`render_chat`'s keyword options."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **options), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)


NORMALIZED_CHARS_FACTOR = 8
"""A normaliser may compose several characters into one (NFC joins a letter and its combining marks) or drop some,
so behind one the longest token's text is multiplied by this for :attr:`ModelTokenizer.max_chars_per_token`."""


def _max_chars_per_token(tokenizer: Tokenizer) -> int:
    """The longest text any token (vocabulary or added) stands for, in characters of the text before the tokenizer
    saw it. A vocabulary entry is its text in the tokenizer's own alphabet (byte-level BPE spells each byte as one
    character, SentencePiece a space as ``▁``, a byte fallback ``<0xNN>``), never shorter than the text it covers."""
    longest = max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    normalized = json.loads(tokenizer.to_str()).get("normalizer") is not None
    return max(1, longest) * (NORMALIZED_CHARS_FACTOR if normalized else 1)


def _special_token_wrap(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens transformers adds around a prompt with ``add_special_tokens=True``: what the tokenizer's
    post-processor adds, found by encoding a probe both ways (e.g. Llama 3's BOS). Transformers 5 (vLLM 0.32's)
    builds a tokenizer with a tokenizer.json from that file alone: ``add_bos_token`` and ``add_eos_token`` in
    tokenizer_config.json change nothing then."""
    probe = "kvgate probe"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    return (full[:at], full[at + len(bare) :]) if at is not None else ([], [])
