"""Exact token ids as the engine computes them: the model's tokenizer.json, its special tokens and its chat template.

:class:`ModelTokenizer` is one model's: loaded from a local model directory, it renders chats with the model's template
(:mod:`kvgate.router.prompts.chat_template`) and encodes with the tokenizers library as transformers and vLLM do. The
gateway's prompt path (:mod:`kvgate.router.prompts.tokenizer`) adds caching, runs it off the event loop and falls
back to ``/tokenize`` or an approximation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from kvgate.router.prompts.chat_template import ChatTemplate, compile_chat_template, render_chat


class ModelTokenizer:
    """One model's tokenizer and chat template, loaded from a local model directory or a tokenizer.json path."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        special_tokens: dict[str, Any] | None = None,
        wrap: tuple[list[int], list[int]] = ([], []),
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens if special_tokens is not None else {}
        """bos/eos/pad/unk token texts, the variables every chat template (the model's or a request's) is given."""
        self.prefix_ids, self.suffix_ids = wrap
        """Special tokens put before / after a prompt encoded with ``add_special_tokens`` (e.g. BOS)."""
        self.max_chars_per_token = _max_chars_per_token(tokenizer)
        """The most characters of prompt text one token can stand for: a prompt of ``c`` characters has at least
        ``c / max_chars_per_token`` tokens."""

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelTokenizer":
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        config_file = tok_file.parent / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(str(tok_file))
        # Transformers' tokenizer call ignores a tokenizer.json's own truncation/padding unless asked; so does vLLM.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_source = config.get("chat_template")
        if isinstance(template_source, list):  # HF allows [{"name": "default", "template": ...}, ...]
            template_source = next((t["template"] for t in template_source if t.get("name") == "default"), None)
        chat_template_file = tok_file.parent / "chat_template.jinja"
        if template_source is None and chat_template_file.exists():
            template_source = chat_template_file.read_text()
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = compile_chat_template(template_source, special) if template_source else None
        return cls(tokenizer, template, special, _special_token_wrap(tokenizer, config, special))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, as vLLM encodes it (special tokens in the text are parsed as such)."""
        # encode_batch releases the GIL (encode does not), so other threads and the event loop keep running.
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.prefix_ids + ids + self.suffix_ids if add_special_tokens else ids

    def template_for(self, chat_template: str | None) -> ChatTemplate:
        """The model's template, or a request's own ``chat_template`` compiled with the model's special tokens.

        Raises ``ValueError`` when there is none, ``jinja2.TemplateSyntaxError`` when the override does not parse.
        """
        if chat_template is not None:
            return compile_chat_template(chat_template, self.special_tokens)
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.chat_template

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | ChatTemplate | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat endpoint builds for these OpenAI messages and options.

        Raises ``ValueError`` / ``jinja2.TemplateError`` for messages or options the template rejects.
        """
        template = chat_template if isinstance(chat_template, ChatTemplate) else self.template_for(chat_template)
        return render_chat(
            template, messages, add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
            documents=documents, chat_template_kwargs=chat_template_kwargs,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **options: Any) -> list[int]:
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


LLAMA_STYLE_CLASSES = frozenset(
    {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast", "GemmaTokenizer",
     "GemmaTokenizerFast"}
)
"""Transformers classes that rebuild the post-processor from ``add_bos_token`` (default true) / ``add_eos_token``."""


def _special_token_wrap(tokenizer: Tokenizer, config: dict[str, Any], special: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The special tokens transformers adds around a prompt with ``add_special_tokens=True``: what the tokenizer's
    post-processor adds (found by encoding a probe both ways, e.g. Llama 3's BOS), or for Llama-style classes what
    ``add_bos_token`` / ``add_eos_token`` say; plus BOS when the config asks for it and nothing added it."""
    probe = "kvgate probe"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    prefix, suffix = (full[:at], full[at + len(bare) :]) if at is not None else ([], [])
    bos = tokenizer.token_to_id(special["bos_token"]) if special.get("bos_token") else None
    eos = tokenizer.token_to_id(special["eos_token"]) if special.get("eos_token") else None
    if config.get("tokenizer_class") in LLAMA_STYLE_CLASSES:
        prefix = [bos] if bos is not None and config.get("add_bos_token", True) else []
        suffix = [eos] if eos is not None and config.get("add_eos_token", False) else []
    elif bos is not None and config.get("add_bos_token") and prefix[:1] != [bos]:
        prefix = [bos, *prefix]
    return prefix, suffix


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": "...", ...}
        return value.get("content")
    return value


