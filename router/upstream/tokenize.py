"""An engine's ``POST /tokenize``, asked of a routable replica: the prompt tokenizer's fallback for models with no
local tokenizer, or content only the engine can turn into tokens (:mod:`kvgate.router.prompts.tokenizer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp

from kvgate.policies.base import NoHealthyReplica


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


class EngineTokenizer:
    def __init__(
        self, session: aiohttp.ClientSession, routable: Callable[[], Sequence[HasUrl]], timeout_s: float
    ) -> None:
        self.session = session
        self.routable = routable
        self.timeout_s = timeout_s

    def reconfigure(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The engine's answer to ``payload`` (a vLLM ``/tokenize`` body); raises on any failure."""
        replicas = self.routable()
        if not replicas:
            raise NoHealthyReplica("no routable replica to tokenize on")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self.session.post(replicas[0].url + "/tokenize", json=payload, timeout=timeout) as resp:
            resp.raise_for_status()
            answer: dict[str, Any] = await resp.json()
            return answer
