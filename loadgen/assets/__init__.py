"""Files kvgate ships: the default tokenizer of the simulated fleet (built by scripts/build_tokenizer.py)."""

from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
DEFAULT_MODEL = "kvgate-sim"
