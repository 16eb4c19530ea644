"""Stored responses of the Responses API: which replica holds each, and what a follow-up is rendered after.

An engine keeps a stored response (and the conversation it came from) in its own process: a follow-up naming it
(``previous_response_id``), a ``GET`` or a cancel must reach that replica. kvgate names every response itself
(:class:`ResponseIds`, the body's ``request_id``, which vLLM makes the response's id): an id carries a MAC of its
tenant, so a request naming another tenant's response, or an id nobody made, is refused before any replica sees it.
Which replica answered is remembered (:class:`StoredResponses`); an id this gateway did not see created (another
gateway's, or from before a restart) is looked for on the replicas (:func:`locate`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


from kvgate.router.upstream.client import EngineClient, UpstreamError
from kvgate.router.apis.responses import History
from kvgate.router.prompts.prompt import plain_text
from kvgate.router.routing.config import ResponsesConfig

ID_PREFIX = "resp_"
NONCE_BYTES = 16
MAC_BYTES = 12


class ResponseIds:
    """``resp_`` + a random nonce + a MAC of the nonce and the tenant, in hex."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret if secret else os.urandom(32)
        """With no secret configured, a random one: ids stay valid only in this process."""

    def mint(self, tenant: str | None) -> str:
        nonce = os.urandom(NONCE_BYTES).hex()
        return f"{ID_PREFIX}{nonce}{self._mac(nonce, tenant)}"

    def valid(self, response_id: str, tenant: str | None) -> bool:
        """Whether ``tenant`` (None without tenants) may name ``response_id``: one kvgate made for it."""
        body = response_id[len(ID_PREFIX):] if response_id.startswith(ID_PREFIX) else ""
        if len(body) != 2 * (NONCE_BYTES + MAC_BYTES) or not body.isascii():
            return False  # hmac.compare_digest raises TypeError on a str with non-ASCII characters (a 500)
        nonce, mac = body[: 2 * NONCE_BYTES], body[2 * NONCE_BYTES:]
        return hmac.compare_digest(mac, self._mac(nonce, tenant))

    def _mac(self, nonce: str, tenant: str | None) -> str:
        message = f"{nonce}\0{tenant or ''}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).digest()[:MAC_BYTES].hex()


@dataclass(slots=True)
class StoredResponse:
    replica: str
    history: History | None = None
    chars: int = 0


class StoredResponses:
    """The replica of each response this gateway saw stored, the least recently used forgotten first, and the
    conversations follow-ups are rendered after, within ``responses.max_history_chars``."""

    def __init__(self, config: ResponsesConfig) -> None:
        self.config = config
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()
        self._history_chars = 0

    def reconfigure(self, config: ResponsesConfig) -> None:
        self.config = config
        self._shrink()

    def record(self, response_id: str, replica: str) -> None:
        self._by_id[response_id] = StoredResponse(replica)
        self._by_id.move_to_end(response_id)
        self._shrink()

    def keep_history(self, response_id: str, history: History) -> None:
        """What a follow-up of ``response_id`` is rendered after (dropped again when over the budget)."""
        stored = self._by_id.get(response_id)
        if stored is None:
            return
        chars = sum(len(plain_text(m.get("content"))) for m in history.messages) + sum(map(len, history.output_texts))
        self._history_chars += chars - stored.chars
        stored.history, stored.chars = history, chars
        self._shrink()

    def replica_of(self, response_id: str) -> str | None:
        stored = self._by_id.get(response_id)
        if stored is None:
            return None
        self._by_id.move_to_end(response_id)
        return stored.replica

    def history_of(self, response_id: str) -> History | None:
        stored = self._by_id.get(response_id)
        return stored.history if stored is not None else None

    def forget(self, response_id: str) -> None:
        stored = self._by_id.pop(response_id, None)
        if stored is not None:
            self._history_chars -= stored.chars

    def _shrink(self) -> None:
        while len(self._by_id) > self.config.max_stored:
            _, dropped = self._by_id.popitem(last=False)
            self._history_chars -= dropped.chars
        for stored in self._by_id.values():  # least recently used first
            if self._history_chars <= self.config.max_history_chars:
                break
            if stored.history is not None:
                self._history_chars -= stored.chars
                stored.history, stored.chars = None, 0

    def __len__(self) -> int:
        return len(self._by_id)


async def locate(client: EngineClient, response_id: str, replicas: Sequence[tuple[str, str]],
                 timeout_s: float) -> str | None:
    """The replica (of (name, base URL) ``replicas``) whose engine answers ``GET /v1/responses/{id}`` with 200, asked
    all at once; None when none does within ``timeout_s``."""

    async def holds(name: str, url: str) -> str | None:
        try:
            answer = await client.fetch("GET", f"{url}/v1/responses/{response_id}", timeout_s=timeout_s)
        except (UpstreamError, OSError, TimeoutError, ValueError):
            return None
        return name if answer.status == 200 else None

    tasks = [asyncio.ensure_future(holds(name, url)) for name, url in replicas]
    try:
        for done in asyncio.as_completed(tasks):
            found = await done
            if found is not None:
                return found
    finally:
        for task in tasks:
            task.cancel()
    return None
