"""An engine's ``POST /tokenize``, asked of a routable replica: the prompt tokenizer's fallback for models with no
local tokenizer, or content only the engine can turn into tokens (:mod:`kvgate.router.prompts.tokenizer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from kvgate.policies.base import NoHealthyReplica
from kvgate.router.upstream.client import EngineClient, UpstreamError


JSON_HEADERS = {"content-type": "application/json"}


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


class EngineTokenizer:
    def __init__(
        self, client: EngineClient, routable: Callable[[], Sequence[HasUrl]], timeout_s: float
    ) -> None:
        self.client = client
        self.routable = routable
        self.timeout_s = timeout_s

    def reconfigure(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The engine's answer to ``payload`` (a vLLM ``/tokenize`` body); raises on any failure."""
        replicas = self.routable()
        if not replicas:
            raise NoHealthyReplica("no routable replica to tokenize on")
        answer = await self.client.fetch("POST", replicas[0].url + "/tokenize", JSON_HEADERS,
                                         msgspec.json.encode(payload), timeout_s=self.timeout_s)
        if answer.status != 200:
            raise UpstreamError(f"/tokenize answered {answer.status}")
        decoded = msgspec.json.decode(answer.body)
        if not isinstance(decoded, dict):
            raise UpstreamError("/tokenize answered something that is not a JSON object")
        return decoded
