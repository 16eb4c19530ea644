"""Whole-word tokens that survive a text round trip, so a prompt built from token ids tokenizes back to those ids.

A byte-level BPE token like ``Ġword`` is safe when ``encode(" word") == [id]``: the pre-tokenizer splits text at every
space-led word, so any concatenation of such words encodes to the concatenation of their ids. The set is computed once
from the tokenizer and every member is verified, so a tokenizer without enough of them is refused instead of producing
prompts whose cached prefixes silently differ from what the workload claims.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from kvgate.loadgen.sim.tokenizer import SimTokenizer

_WORD = re.compile(r"Ġ[A-Za-z]+")
MIN_WORDS = 1000


class WordVocabulary:
    """Round-trip-safe whole-word token ids of one tokenizer, and their text."""

    def __init__(self, tokenizer: SimTokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.tokenizer.get_vocab()
        words = sorted((i, tok[1:]) for tok, i in vocab.items() if _WORD.fullmatch(tok))
        safe = [(i, w) for i, w in words if tokenizer.encode(" " + w, add_special_tokens=False) == [i]]
        if len(safe) < MIN_WORDS:
            raise ValueError(f"tokenizer has only {len(safe)} round-trip-safe whole-word tokens (need {MIN_WORDS})")
        self.ids: list[int] = [i for i, _ in safe]
        self._text: dict[int, str] = {i: " " + w for i, w in safe}

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.ids, k=n)

    def render(self, ids: Sequence[int]) -> str:
        """Text that tokenizes back to exactly ``ids`` (each id must come from this vocabulary)."""
        return "".join(self._text[i] for i in ids)


@lru_cache(maxsize=4)
def vocabulary_for(tokenizer_dir: Path) -> WordVocabulary:
    return WordVocabulary(SimTokenizer.from_path(tokenizer_dir))
