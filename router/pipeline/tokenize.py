"""The tokenize stage: the replicas that may serve the request's model, its base model and LoRA adapter, the model's
routing state, and the prompt's token ids exactly as the engine will see them (:mod:`kvgate.router.prompts`)."""

from __future__ import annotations

import functools

from kvgate.policies.base import NoHealthyReplica
from kvgate.router.pipeline.errors import routing_errors
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.prompts.prompt import PromptError
from kvgate.router.prompts.tokenizer import PromptTokenizer, TokenizedPrompt
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.model_state import ModelStates
from kvgate.router.routing.records import Prompt


class TokenizeStage:
    def __init__(self, catalog: ModelCatalog, models: ModelStates, tokenizer: PromptTokenizer) -> None:
        self.catalog = catalog
        self.models = models
        self.tokenizer = tokenizer

    async def tokenize(self, parsed: Parsed) -> Prompt:
        """Raises (as a 503) when no replica may serve the model, before tokenizing, and (as a 400) for a prompt the
        engine would refuse or one longer than the model takes."""
        api = parsed.api
        assert api is not None
        with routing_errors():
            names = self.catalog.candidates(parsed.model)
            if not self.catalog.takes_requests(names):
                raise NoHealthyReplica(parsed.model)
            base_model, lora = self.catalog.fleet.base_model_of(parsed.model)
            routing = self.models.of(base_model)
            limit = self.catalog.max_model_len(base_model)
            tokenized = await self.tokenizer.tokenize(
                base_model, functools.partial(api.prompt, parsed.body), namespace=parsed.cache_salt,
                body_bytes=len(parsed.raw), max_model_len=limit,
            )
            check_length(limit, tokenized, api.prompt_param)
        return Prompt(parsed.model, base_model, lora, names, routing, tokenized, parsed.cache_salt, parsed.max_tokens)


def check_length(limit: int | None, tokenized: TokenizedPrompt, param: str) -> None:
    """A prompt longer than the model takes (``limit`` tokens) is refused here, as the engine would answer
    (approximate counts are not exact enough to refuse on)."""
    tokens = len(tokenized.token_ids)
    if limit is not None and tokens > limit and not tokenized.approximate:
        raise PromptError(
            f"This model's maximum context length is {limit} tokens. However, your request has {tokens} input "
            "tokens. Please reduce the length of the input.", param, "context_length_exceeded",
        )
