"""Cutting prompt text into pieces that encode independently, so a growing chat or a re-sent document re-encodes
only what is new (:class:`PromptSplitter`; the pieces' ids are cached by :mod:`kvgate.router.prompts.piece_cache`)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

from tokenizers import Tokenizer

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
