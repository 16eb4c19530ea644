"""Where a streamed completion's first token is: past any role-only chat chunk.

An OpenAI-compatible chat stream may open with a chunk that carries only ``{"role": "assistant", "content": ""}``.
Engines that send it before the prefill has run (kvgate's simulator does; vLLM sends it with the first output) make
the first body byte useless as a time to first token: the router would release a request's pending prefill from
its replica's queue estimate at once (the cost policy then sees a replica busy prefilling a long prompt as idle) and
feed calibration a "TTFT" of a few milliseconds. The proxy therefore reads on until an event that is not role-only.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

MAX_HELD_BYTES = 65536
"""Never hold more than this much of a stream back looking for its first token (an odd stream is passed on)."""


class ByteStream(Protocol):
    """What is read from: an upstream response's body (``aiohttp.StreamReader``)."""

    async def readany(self) -> bytes: ...


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _role_only(payload: bytes) -> bool:
    """A chat chunk whose every choice has an empty delta apart from its role, and no finish."""
    try:
        chunk = _chunk_decoder.decode(payload)
    except msgspec.DecodeError:
        return False
    return bool(chunk.choices) and all(
        c.delta is not None and not c.delta.content and not c.delta.reasoning_content and not c.delta.tool_calls
        and c.text is None and c.finish_reason is None
        for c in chunk.choices
    )


def holds_output(buffer: bytes) -> bool:
    """True once ``buffer`` (the start of an SSE stream) has a complete event that is not a role-only chat chunk:
    a token, a finish, an error, ``[DONE]``, or anything this does not understand (never hold an odd stream)."""
    if b'"role"' not in buffer or len(buffer) >= MAX_HELD_BYTES:
        return True
    *complete, _partial = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    for event in complete:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event names, ids
            if not _role_only(line[5:].strip()):
                return True
    return False


async def read_to_first_token(content: ByteStream) -> bytes:
    """Read a streaming body until its first token has arrived (see :func:`holds_output`); the bytes read, to be
    sent on as the stream's first chunk. Fewer when the stream ends first; empty when it sent nothing."""
    buffer = b""
    while True:
        chunk = await content.readany()
        if not chunk:
            return buffer
        buffer += chunk
        if holds_output(buffer):
            return buffer
