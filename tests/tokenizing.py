"""Tokenizing an OpenAI body in tests, as the gateway's tokenize stage does: the API's parser, run by the tokenizer."""

from __future__ import annotations

import functools
from typing import Any, Literal

from kvgate.router.apis.openai import parse_chat, parse_completion
from kvgate.router.prompts.tokenizer import PromptTokenizer, TokenizedPrompt


async def tokenize_body(
    tokenizer: PromptTokenizer, model: str, endpoint: Literal["chat", "completions"], body: dict[str, Any],
    **options: Any,
) -> TokenizedPrompt:
    parse = parse_chat if endpoint == "chat" else parse_completion
    return await tokenizer.tokenize(model, functools.partial(parse, body), **options)
