"""The tokenize stage: the replicas that may serve the request's model, its base model and LoRA adapter, the model's
routing state, and the prompt's token ids exactly as the engine will see them (:mod:`kvgate.router.prompts`): exact
unless the parity monitor (:mod:`kvgate.router.routing.parity`) caught the model's counts disagreeing with the
engine's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvgate.policies.base import NoHealthyReplica
from kvgate.router.pipeline.errors import routing_errors
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.prompts.prompt import ChatPrompt, PromptError
from kvgate.router.prompts.tokenizer import PromptTokenizer, TokenizedPrompt
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.model_state import ModelStates
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.routing.records import Prompt

if TYPE_CHECKING:
    from kvgate.router.pipeline.spans import RequestTrace


class TokenizeStage:
    def __init__(self, catalog: ModelCatalog, models: ModelStates, tokenizer: PromptTokenizer,
                 parity: ParityMonitor) -> None:
        self.catalog = catalog
        self.models = models
        self.tokenizer = tokenizer
        self.parity = parity
        """A model whose token counts the engine contradicts routes its prompts as approximate ones."""

    async def tokenize(
        self, parsed: Parsed, *, prompt_of: Callable[[], ChatPrompt] | None = None, pinned: str | None = None,
        partial: bool = False, trace: RequestTrace | None = None, lead: bool = False,
    ) -> Prompt:
        """Raises (as a 503) when no replica may serve the model, before tokenizing, and (as a 400) for a prompt the
        engine would refuse or one longer than the model takes. ``prompt_of`` makes the prompt (the API's parser of
        the body by default); ``pinned``, the one replica the request may go to; ``partial``, the prompt is not all
        the engine will run (:attr:`~kvgate.router.routing.records.Prompt.partial`); ``trace``, the request's spans
        when it is traced; ``lead``, a long uncached prompt may come back as its beginning while the rest is
        encoded (:attr:`~kvgate.router.prompts.tokenizer.TokenizedPrompt.rest`; :meth:`whole` waits for it), for a
        model whose counts the engine confirms."""
        api = parsed.api
        assert api is not None
        if trace is not None:
            trace.stage("tokenize")
        with routing_errors():
            names = [pinned] if pinned is not None else self.catalog.candidates(parsed.model)
            if not self.catalog.takes_requests(names):
                raise NoHealthyReplica(parsed.model)
            base_model, lora = self.catalog.fleet.base_model_of(parsed.model)
            routing = self.models.of(base_model)
            limit = self.catalog.max_model_len(base_model)
            trusted = self.parity.trusted(base_model)
            tokenized = await self.tokenizer.tokenize(
                base_model, prompt_of or functools.partial(api.prompt, parsed.body), namespace=parsed.cache_salt,
                body_bytes=len(parsed.raw), max_model_len=limit, lead=lead and trusted and not partial,
            )
            if not partial and tokenized.rest is None:
                check_length(limit, tokenized, api.prompt_param)
            if partial or not trusted:
                tokenized = dataclasses.replace(tokenized, approximate=True)
        return Prompt(parsed.model, base_model, lora, names, routing, tokenized, parsed.cache_salt, parsed.max_tokens,
                      partial)

    async def whole(self, prompt: Prompt, param: str) -> Prompt:
        """``prompt`` with all its token ids, once the rest of a prompt tokenized with ``lead`` is; as
        :meth:`tokenize`, a prompt longer than the model takes is a 400 (``param`` names it)."""
        rest = prompt.tokenized.rest
        if rest is None:
            return prompt
        with routing_errors():
            tokenized = await rest
            check_length(self.catalog.max_model_len(prompt.base_model), tokenized, param)
        return dataclasses.replace(prompt, tokenized=tokenized)


def check_length(limit: int | None, tokenized: TokenizedPrompt, param: str) -> None:
    """A prompt longer than the model takes (``limit`` tokens) is refused here, as the engine would answer
    (approximate counts are not exact enough to refuse on)."""
    tokens = len(tokenized.token_ids)
    if limit is not None and tokens > limit and not tokenized.approximate:
        raise PromptError(
            f"This model's maximum context length is {limit} tokens. However, your request has {tokens} input "
            "tokens. Please reduce the length of the input.", param, "context_length_exceeded",
        )
