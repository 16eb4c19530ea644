"""An OpenAI stream's first output is its first SSE event that is not a role-only chat chunk, and the proxy reads up
to it."""

from __future__ import annotations

import asyncio

from kvgate.router.apis.openai import MAX_HELD_BYTES, holds_output
from kvgate.router.upstream.first_token import read_to_first_output

ROLE = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')
TOKEN = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" Hi"}}]}\n\n'


def test_role_only_chunk_is_not_output() -> None:
    assert not holds_output(ROLE)
    assert not holds_output(ROLE + TOKEN[:20])  # the token's event is not complete yet
    assert holds_output(ROLE + TOKEN)
    assert holds_output(ROLE.replace(b"\n\n", b"\r\n\r\n") + TOKEN.replace(b"\n\n", b"\r\n\r\n"))


def test_every_other_first_event_is_output() -> None:
    assert holds_output(TOKEN)
    assert holds_output(b'data: {"choices":[{"text":" Hi","index":0}]}\n\n')  # completions
    assert holds_output(b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n')  # role with a token
    assert holds_output(b'data: {"choices":[{"delta":{"role":"assistant"},"finish_reason":"length"}]}\n\n')
    assert holds_output(b'data: {"choices":[{"delta":{"role":"assistant","tool_calls":[{"id":"t"}]}}]}\n\n')
    assert holds_output(ROLE + b"data: [DONE]\n\n")
    assert holds_output(ROLE + b'data: {"error":{"message":"boom","role":"x"}}\n\n')
    assert holds_output(b'data: {"role": not json}\n\n')
    assert holds_output(ROLE * (MAX_HELD_BYTES // len(ROLE) + 1))  # never hold an odd stream for long


class _Reader:
    """An upstream body arriving in ``parts``, then its end (``b""``), like aiohttp's ``readany``."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = list(parts)

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        return self.parts.pop(0) if self.parts else b""


def test_read_to_first_output_reads_past_the_role_chunk() -> None:
    async def go() -> list[bytes]:
        return [
            await read_to_first_output(_Reader([ROLE, TOKEN[:30], TOKEN[30:], TOKEN]), holds_output),
            await read_to_first_output(_Reader([TOKEN, TOKEN]), holds_output),
            await read_to_first_output(_Reader([ROLE]), holds_output),
            await read_to_first_output(_Reader([]), holds_output),
        ]

    past_role, plain, role_then_end, empty = asyncio.run(asyncio.wait_for(go(), 5))
    assert past_role == ROLE + TOKEN
    assert plain == TOKEN
    assert role_then_end == ROLE
    assert empty == b""
