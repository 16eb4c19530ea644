"""Build the real-engine suite's model: a tiny random-weight Llama around kvgate's shipped tokenizer.

Runs in the engines' environment (``scripts/engines_env.sh``: it needs torch and transformers). Nothing is
downloaded: the architecture is declared here, the weights are random (seeded), and the tokenizer files are copied
from ``loadgen/assets/tokenizer``, chat template included, so the engine and kvgate tokenize and render chat alike.
The model is small enough for a CPU replica to start in under a minute and prefill thousands of tokens in a tenth of
a second, and exercises everything kvgate reads from an engine: prefix caching, KV events, replay, metrics, usage.

    python scripts/build_tiny_model.py --out DIR [--tokenizer loadgen/assets/tokenizer]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZER = Path(__file__).resolve().parent.parent / "loadgen" / "assets" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build(out: Path, tokenizer: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer / "tokenizer.json").read_text(encoding="utf-8"))
    vocab_size = len(vocab["model"]["vocab"]) + sum(
        1 for t in vocab.get("added_tokens", []) if t["content"] not in vocab["model"]["vocab"]
    )
    special = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        eos_token_id=special.get(settings.get("eos_token")),
        pad_token_id=special.get(settings.get("pad_token")),
        bos_token_id=special.get(settings.get("bos_token")),
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {out}: {params / 1e6:.1f} M parameters, vocabulary {vocab_size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write (replaced if present)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="directory with tokenizer.json and "
                        "tokenizer_config.json (default: kvgate's shipped tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, args.tokenizer, args.seed)


if __name__ == "__main__":
    main()
