"""The served model as the fleet sees it: its name, tokenizer, and the word tokens simulated completions are made of."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .tokenizer import SimTokenizer


@dataclass(frozen=True, slots=True)
class SimModel:
    name: str
    tokenizer: SimTokenizer
    tokenizer_path: Path
    vocab_size: int
    output_vocab: list[int]
    """Token ids generated text is drawn from: whole words, so completions read as text and re-tokenize sanely."""
    token_text: dict[int, str]

    @classmethod
    def load(cls, name: str, tokenizer_path: str | Path) -> "SimModel":
        path = Path(tokenizer_path).resolve()
        tokenizer = SimTokenizer.from_path(path)
        vocab_size = tokenizer.vocab_size
        special = tokenizer.special_ids
        words = [
            i for i in range(vocab_size)
            if i not in special and (t := tokenizer.token_text(i)) and t[0] in "Ġ▁" and t[1:].isalpha() and len(t) > 3
        ]
        output_vocab = words[:2000] or [i for i in range(min(vocab_size, 2000)) if i not in special]
        token_text = {i: tokenizer.decode([i]) for i in output_vocab}
        return cls(name, tokenizer, path, vocab_size, output_vocab, token_text)

    def text(self, ids: list[int]) -> str:
        return "".join(self.token_text[i] for i in ids)
