"""A model's special tokens as transformers hands them to its chat template: ``tokenizer.special_tokens_map``.

Transformers 5 (``tokenization_utils_base.py``: ``_from_pretrained`` L1803-1816, ``__init__`` L1019-1050,
``special_tokens_map`` L1341-1358) names the seven standard tokens and a model's own named tokens, and leaves out
every one whose value is null: a ``bos_token: null`` tokenizer's template sees no ``bos_token`` at all, so
``{{ bos_token }}`` renders nothing and ``bos_token is defined`` is false (never the text ``None``).
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""Transformers' ``SPECIAL_TOKENS_ATTRIBUTES``: the named tokens every tokenizer has, each possibly unset."""


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The template variables a tokenizer_config.json's special tokens become: each of
    :data:`SPECIAL_TOKENS_ATTRIBUTES` that is not null, then the model's own named tokens (any other ``*_token`` key
    holding a token, and the entries of an ``extra_special_tokens`` mapping, or of ``additional_special_tokens`` when
    that is unset), each an added token's ``content``. A plain list of extra tokens names nothing and adds no
    variable.

    Raises ``ValueError`` for a token transformers refuses to load (neither text nor a serialised AddedToken).
    """
    tokens = {key: _token_text(key, config[key]) for key in SPECIAL_TOKENS_ATTRIBUTES if config.get(key) is not None}
    for key, value in config.items():
        if key.endswith("_token") and key not in SPECIAL_TOKENS_ATTRIBUTES and _is_token(value):
            tokens[key] = _token_text(key, value)
    extra = config.get("extra_special_tokens")
    if not extra:  # transformers 5 reads the older name in its place
        extra = config.get("additional_special_tokens")
    if isinstance(extra, dict):
        tokens.update({key: _token_text(key, value) for key, value in extra.items()})
    return tokens


def _is_token(value: Any) -> bool:
    return isinstance(value, str) or _is_added_token(value)


def _is_added_token(value: Any) -> bool:
    """An AddedToken as tokenizer_config.json serialises it: ``{"__type": "AddedToken", "content": ...}``."""
    return isinstance(value, dict) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str)


def _token_text(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if _is_added_token(value):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {key} must be a string or an AddedToken, as transformers requires")
