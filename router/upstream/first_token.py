"""Reading a streamed answer up to its first output, which is when its prefill is done.

What counts as the first output is the API's to say (:attr:`kvgate.router.apis.base.Api.holds_output`: an OpenAI
chat stream may open with a role-only chunk sent before the prefill ran); the reading is the same for every API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class ByteStream(Protocol):
    """What is read from: an upstream response's body (:class:`~kvgate.router.upstream.client.EngineResponse`)."""

    async def readany(self) -> bytes: ...


async def read_to_first_output(content: ByteStream, holds_output: Callable[[bytes], bool]) -> bytes:
    """Read a streaming body until ``holds_output`` says its first output has arrived; the bytes read, to be sent on
    as the stream's first chunk. Fewer when the stream ends first; empty when it sent nothing."""
    buffer = b""
    while True:
        chunk = await content.readany()
        if not chunk:
            return buffer
        buffer += chunk
        if holds_output(buffer):
            return buffer
