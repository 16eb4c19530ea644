"""The relay stage: the engine's answer sent on to the client with kvgate's headers, streamed chunk by chunk as it
comes, and its end reported once (how it ended, the engine's usage) for accounting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvgate.router.apis.base import Api, Usage
from kvgate.router.core.errors import OPENAI_ERRORS, ApiError
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.pipeline.disconnect import cancel_on_disconnect, left_early

StreamEnd = Literal["ok", "stream_error", "client_disconnect"]
TAIL_BYTES = 16384
"""How much of a stream's end is kept to read its usage and find its end marker in."""


@dataclass(slots=True)
class StreamResult:
    end: StreamEnd
    usage: Usage | None
    finished_at: float


Finished = Callable[[Upstream, StreamResult | None], None]
"""Called once the answer is complete: with the stream's result, or None for an answer read whole."""


def kvgate_headers(request_id: str, reason: str | None, replica: str | None = None) -> dict[str, str]:
    """The headers kvgate puts on every answer to a proxied request: its id, the decision's reason and the replica
    that answered (when one did)."""
    headers = {"x-request-id": request_id}
    if replica is not None:
        headers["x-kvgate-replica"] = replica
    if reason is not None:
        headers["x-kvgate-decision"] = reason
    return headers


def relay(up: Upstream, api: Api | None, request_id: str, reason: str, stream: bool, finished: Finished) -> Response:
    """The client's response: the engine's answer with kvgate's headers, streamed when it is a stream; ``finished``
    runs when it is complete (a stream's end, or at once)."""
    headers = up.client_headers()
    headers.update(kvgate_headers(request_id, reason, up.replica))
    if stream and up.status == 200 and api is not None:
        def on_end(result: StreamResult) -> None:
            up.ticket.finish(result.end != "stream_error")
            finished(up, result)

        return RelayResponse(relay_stream(up, api, on_end), status_code=up.status, headers=headers)
    up.settle()
    finished(up, None)
    if up.status >= 400:
        shape = api.errors if api is not None else OPENAI_ERRORS
        body, headers["content-type"] = shape.from_engine(up.status, up.body, headers.get("content-type"))
        return Response(body, status_code=up.status, headers=headers)
    return Response(up.body, status_code=up.status, headers=headers)


async def relay_stream(upstream: Upstream, api: Api, on_end: Callable[[StreamResult], None]) -> AsyncIterator[bytes]:
    """Yield the upstream's SSE bytes to the client as they arrive, chunk by chunk (no buffering).

    After the first byte nothing is retried: an upstream failure ends the stream with the API's error events. When the
    client leaves (the generator is closed or cancelled), the upstream connection is closed at once so the engine
    aborts the sequence. A client that leaves once the stream's end marker has been relayed had the whole answer:
    the official openai client closes its response on reading ``[DONE]``, often before the upstream's body has ended,
    so that ends ``ok``. ``on_end`` is called exactly once with how the stream ended and the usage seen in its tail.
    """
    resp = upstream.response
    end: StreamEnd = "client_disconnect"
    prev = b""
    last = upstream.body
    try:
        yield last
        try:
            async for chunk in resp.content.iter_any():
                prev, last = last, chunk
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            end = "stream_error"
            yield _stream_error(api, f"upstream replica failed mid-stream: {type(e).__name__}")
            return
        tail = prev[-TAIL_BYTES:] + last
        if not api.stream_complete(tail) and resp.content_type == "text/event-stream":
            end = "stream_error"
            yield _stream_error(api, "upstream replica ended the stream early")
            return
        end = "ok"
    finally:
        if end == "ok":
            resp.release()
        else:
            resp.close()
        tail = prev[-TAIL_BYTES:] + last
        if end == "client_disconnect" and api.stream_complete(tail):
            end = "ok"
        usage = api.usage_of_stream_tail(tail) if end == "ok" else None
        on_end(StreamResult(end, usage, time.monotonic()))


def _stream_error(api: Api, message: str) -> bytes:
    return api.errors.stream_events(ApiError(502, message, code="upstream_stream_error"))


class RelayResponse(Response):
    """Streams a relay (:func:`relay_stream`) to the client and always finalises it when the ASGI call ends (done,
    cancelled, or the client disconnected), instead of leaving the generator to the garbage collector: the upstream
    is closed at once.

    Not Starlette's StreamingResponse: under uvicorn's ASGI spec 2.3 that runs every stream in an anyio task group
    with a second task listening for the disconnect. Here one watcher task cancels the stream instead, which costs
    less CPU per response and ends the relay just as promptly."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: Mapping[str, str]) -> None:
        self.body_iterator = chunks
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(cancel_on_disconnect(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left_early(watcher):
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
