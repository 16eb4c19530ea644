"""Build the small tokenizer kvgate ships (loadgen/assets/tokenizer), so everything runs offline.

A byte-level BPE (GPT-2 style) with an 8,192-token vocabulary, trained with the tokenizers library on a
deterministic synthetic corpus of pronounceable pseudo-words plus a little English, and a ChatML chat template.
Byte-level means any text encodes (no unknown tokens); pseudo-words give thousands of whole-word tokens, which the
workload generators use to write text that tokenizes back to exactly the ids they chose.

Run: python scripts/build_tokenizer.py   (writes tokenizer.json and tokenizer_config.json; output is deterministic)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parent.parent / "loadgen" / "assets" / "tokenizer"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ENGLISH = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get come made may part system "
    "user assistant question answer document please summarize explain context cache prefix model request token"
).split()


def corpus(seed: int = 0, words: int = 400_000) -> list[str]:
    rng = random.Random(seed)
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "kl", "pl", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "n", "r", "s", "l", "m", "x"]
    lexicon = sorted({
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(12_000)
    })
    vocab = lexicon + ENGLISH * 20
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(vocab))
        if len(line) >= 16:
            lines.append(" ".join(line))
            line = []
    return lines


def build() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {OUT} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    build()
