"""Exact token ids as the engine computes them: the model's tokenizer.json and its chat template.

This module holds the per-model tokenizer (:class:`ModelTokenizer`): chat messages are converted the way vLLM converts
OpenAI messages for a template, rendered with the model's template (jinja2, sandboxed, as Hugging Face and vLLM do),
and encoded with the tokenizers library. The router's prompt path (:mod:`router.prompts.tokenizer`) adds caching, runs
it off the event loop and falls back to ``/tokenize`` or an approximation. The simulated fleet has its own
implementation (``loadgen/sim/tokenizer.py``); golden tests hold both to ``transformers``' own ``apply_chat_template``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

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


Piece = str | int
"""A stretch of prompt text the tokenizer encodes on its own, or the id of an added token found in the prompt."""

BYTE_LEVEL_SPLIT_PATTERNS = frozenset(
    {
        # Llama 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        # Qwen 2 / 2.5 / 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
"""Pre-tokenizer regexes (used with a regex-less ByteLevel) under which a letter or digit followed by a newline always
ends a pre-token (punctuation does not: it absorbs the newlines that follow)."""

ASCII_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
ASCII_GRAPHIC = frozenset(chr(c) for c in range(0x21, 0x7F))
"""GPT-2's ByteLevel regex ends a pre-token at any non-space character followed by whitespace; ASCII keeps the test
free of Unicode whitespace-class differences between Python and the tokenizer's regex engine."""

LONG_PIECE_FACTOR = 16
"""Pieces away from the end of a long text are this many times ``chunk_chars``."""
TAIL_PIECE_DIVISOR = 4
"""The text's last ``chunk_chars`` piece is cut again into pieces this many times smaller: a prompt that re-sends a
document with a new ending then re-encodes ~``chunk_chars / 8`` characters of the document on average instead of
~``chunk_chars / 2`` (encoding is the costly step), for two or three more look-ups."""


class PromptSplitter:
    """Cuts prompt text into pieces whose token ids, concatenated, equal the ids of the whole text.

    Two cuts are used, each only after a self-check on the loaded tokenizer proves it exact there:

    * at added tokens (``<|im_start|>``...): Hugging Face tokenizers extract them before normalising and
      pre-tokenising, so the text between two of them is encoded independently. Chat templates put them around every
      message, so a growing chat re-encodes only its new messages.
    * inside long text (documents), before a space or newline that follows an ASCII letter or digit (for GPT-2's
      ByteLevel regex: any ASCII non-space character), every ``chunk_chars`` characters or so near the end of the text
      (the very last stretch every ``chunk_chars / TAIL_PIECE_DIVISOR``) and ``LONG_PIECE_FACTOR`` times that before:
      with a ByteLevel pre-tokenizer of the GPT-2 / Llama 3 / Qwen family no pre-token spans that point (each pattern
      ends a word, number or punctuation run before whitespace and only ever starts one with it), and BPE never merges
      across pre-tokens. Cut points depend only on the text before them, so two prompts sharing a document prefix
      share its pieces; text with no newline at all (a one-line document) is cut as well. Only made in text free of
      added tokens (so none can straddle a cut).

    When a check fails (another tokenizer family, added tokens that strip whitespace...) that cut is simply not made
    and the larger piece is encoded whole: slower, never wrong.
    """

    def __init__(self, tokenizer: Tokenizer, chunk_chars: int = 2048):
        self.chunk_chars = chunk_chars
        added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
        spec = json.loads(tokenizer.to_str())
        self._added_ids = added
        self._added_re = _added_token_pattern(tokenizer, spec, added)
        self._cut_re: re.Pattern[str] | None = None
        self.splits_at_added_tokens = self._added_re is not None and self._check_added_token_cuts(tokenizer, added)
        if not self.splits_at_added_tokens:
            self._added_re = None
        if self.splits_at_added_tokens or not added:
            self._cut_re = _cut_pattern(_chunk_end_chars(spec))
        if self._cut_re is not None and not self._check_chunk_cuts(tokenizer, added):
            self._cut_re = None

    @property
    def splits_long_text(self) -> bool:
        return self._cut_re is not None

    def pieces(self, text: str) -> list[Piece]:
        if self._added_re is None:
            return self._chunks(text) if text else []
        pieces: list[Piece] = []
        for i, part in enumerate(self._added_re.split(text)):
            if i % 2:
                pieces.append(self._added_ids[part])
            elif part:
                pieces.extend(self._chunks(part))
        return pieces

    def _chunks(self, text: str) -> list[Piece]:
        """Pieces of ~``LONG_PIECE_FACTOR × chunk_chars`` characters, except the text's last stretch of at least that
        many, which is cut every ~``chunk_chars``, and the last of those pieces, cut every ~``chunk_chars /
        TAIL_PIECE_DIVISOR``: a prompt that re-sends a long document with a new ending re-encodes only a short tail,
        and a warm 100k-character document is a few dozen look-ups, not hundreds.

        The tail's cuts start at the last ``chunk_chars`` cut, which depends only on the text before it as long as the
        new ending is too short to make another one; a longer ending re-encodes that last ``chunk_chars`` piece of the
        document whole, as it would without the tail's cuts."""
        size = self.chunk_chars
        if self._cut_re is None or len(text) < 2 * size:
            return [text]
        cuts = self._cuts(text, 0, LONG_PIECE_FACTOR * size, keep=LONG_PIECE_FACTOR * size)
        cuts += self._cuts(text, cuts[-1] if cuts else 0, size, keep=0)
        cuts += self._cuts(text, cuts[-1] if cuts else 0, max(1, size // TAIL_PIECE_DIVISOR), keep=0)
        bounds = [0, *cuts, len(text)]
        return [text[start:end] for start, end in zip(bounds, bounds[1:])]

    def _cuts(self, text: str, start: int, size: int, keep: int) -> list[int]:
        """Cut positions after ``start``: the first cut point once ``size`` characters have passed since the last
        cut, keeping at least ``keep`` characters after the last one. Each depends only on the text before it, so
        prompts sharing a prefix share its pieces; each search starts where the last one may cut. The fine cuts keep
        nothing: a document re-sent with a new ending then re-encodes at most ~``size`` characters of it with the
        ending, not ``size`` to ``2 × size``."""
        search = self._cut_re.search  # type: ignore[union-attr]
        cuts: list[int] = []
        stop = len(text) - keep
        while (found := search(text, start + size, stop)) is not None:
            start = found.start()
            cuts.append(start)
        return cuts

    def _check_added_token_cuts(self, tokenizer: Tokenizer, added: dict[str, int]) -> bool:
        texts = [sample.format(token) for sample in _ADDED_TOKEN_SAMPLES for token in added]
        texts += _random_texts(list(added), count=200, length=60)
        return all(self._encode_pieces(tokenizer, t) == _encode_plain(tokenizer, t) for t in texts)

    def _check_chunk_cuts(self, tokenizer: Tokenizer, added: dict[str, int]) -> bool:
        saved = self.chunk_chars
        self.chunk_chars = 1  # cut at every eligible point: the strictest test of the rule
        try:
            texts = _random_texts(list(added), count=100, length=400)
            return all(self._encode_pieces(tokenizer, t) == _encode_plain(tokenizer, t) for t in texts)
        finally:
            self.chunk_chars = saved

    def _encode_pieces(self, tokenizer: Tokenizer, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pieces(text):
            ids.extend([piece] if isinstance(piece, int) else _encode_plain(tokenizer, piece))
        return ids


def _encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _added_token_pattern(tokenizer: Tokenizer, spec: dict[str, Any], added: dict[str, int]) -> re.Pattern[str] | None:
    """A regex finding added tokens leftmost-longest, as the tokenizer does; None when some added token strips
    neighbouring whitespace or matches on normalised text (cuts there would not be exact)."""
    if not added:
        return None
    has_normalizer = spec.get("normalizer") is not None
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and has_normalizer):
            return None
    alternatives = sorted(added, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")


def _cut_pattern(end_chars: frozenset[str]) -> re.Pattern[str] | None:
    """A space or newline right after one of ``end_chars`` (the cut is made before it); None when there are none.
    The whitespace comes first in the pattern so the regex engine scans for it with its fast character-set search."""
    if not end_chars:
        return None
    return re.compile("[ \n](?<=[" + "".join(re.escape(c) for c in sorted(end_chars)) + "][ \n])")


def _chunk_end_chars(spec: dict[str, Any]) -> frozenset[str]:
    """Characters after which a newline always starts a new pre-token for this tokenizer (its tokenizer.json as a
    dict); empty when unknown."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
        return frozenset()
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        gpt2_regex = bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", False)
        return ASCII_GRAPHIC if gpt2_regex else frozenset()
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return frozenset()
    split, byte_level = steps
    known_split = (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in BYTE_LEVEL_SPLIT_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space", False)
    )
    return ASCII_ALNUM if known_split else frozenset()


_ADDED_TOKEN_SAMPLES = (
    "a{0}b",
    " {0} ",
    "\n{0}\n\n",
    "{0}{0}",
    "x{0}y{0}z",
    "  hello {0}world  ",
    "don't{0}'s",
    "1234{0}5678",
    "é中文{0}😀 ",
)


def _random_texts(added: list[str], count: int, length: int) -> list[str]:
    """Deterministic adversarial texts: runs of spaces and newlines, contractions, digits, punctuation, unicode."""
    rng = random.Random(20261129)
    atoms = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "Z", "word", " the", "'s", "'ll", "'", "1", "2024", "3.14",
             ".", ",", "!?", "...", "-", "_", "(", ")", "{", "}", "<", "|", ">", "é", "ß", "中文", "😀", "\u00a0",
             "\u3000", "x\n", "9\n", "a.\n", ";\n", ")\n", " \n", "\u00a0\n", "\n "] + added
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, length))) for _ in range(count)]
