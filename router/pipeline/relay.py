"""The relay stage: the engine's answer sent on to the client with kvgate's headers, streamed chunk by chunk as it
comes, and its end reported once (how it ended, the engine's usage) for accounting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from starlette.responses import Response

from kvgate.router.apis.base import Api, Usage
from kvgate.router.core.errors import OPENAI_ERRORS, ApiError
from kvgate.router.core.http import BodyWriter, StreamedAnswer
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.upstream.client import UpstreamError

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


def relay(
    up: Upstream, api: Api | None, request_id: str, reason: str, stream: bool, finished: Finished
) -> Response | StreamedAnswer:
    """The client's answer: the engine's with kvgate's headers, streamed when it is a stream; ``finished`` runs when
    it is complete: at a stream's end, or just after an answer read whole is written (it is called soon, not now,
    so the client's answer does not wait for its accounting)."""
    headers = up.client_headers()
    headers.update(kvgate_headers(request_id, reason, up.replica))
    if stream and up.status == 200 and api is not None:
        def on_end(result: StreamResult) -> None:
            up.ticket.finish(result.end != "stream_error")
            finished(up, result)

        return StreamedAnswer(up.status, headers, RelayStream(up, api, on_end))
    up.settle()
    asyncio.get_running_loop().call_soon(finished, up, None)
    if up.status >= 400:
        shape = api.errors if api is not None else OPENAI_ERRORS
        body, headers["content-type"] = shape.from_engine(up.status, up.body, headers.get("content-type"))
        return Response(body, status_code=up.status, headers=headers)
    return Response(up.body, status_code=up.status, headers=headers)


class RelayStream:
    """The upstream's SSE bytes, to the client as they arrive, chunk by chunk (no buffering): the first chunk (read
    already, to find the first output), then each one the engine sends, handed from the upstream connection's own
    callback straight to the client's (:meth:`EngineResponse.pipe`: a chunk costs a call, not a task switch; a full
    client socket pauses the engine's).

    After the first byte nothing is retried: an upstream failure ends the stream with the API's error events. When the
    client leaves, the server cancels the writing and closes this stream (:meth:`aclose`): the upstream connection is
    closed at once so the engine aborts the sequence. A client that leaves once the stream's end marker has been
    relayed had the whole answer: the official openai client closes its response on reading ``[DONE]``, often before
    the upstream's body has ended, so that ends ``ok``. The server closes it (:meth:`aclose`) however it ends, even
    before it was written: that calls ``on_end``, once, with how it ended and the usage in its tail."""

    def __init__(self, upstream: Upstream, api: Api, on_end: Callable[[StreamResult], None]) -> None:
        self.response = upstream.response
        self.api = api
        self.on_end = on_end
        self.end: StreamEnd = "client_disconnect"
        self._prev = b""
        self._last = upstream.body
        self._closed = False

    async def write_to(self, out: BodyWriter) -> None:
        out.write(self._last)
        over: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def relay(chunk: bytes) -> None:
            self._prev, self._last = self._last, chunk
            out.write(chunk)

        def ended(error: BaseException | None) -> None:
            if not over.done():
                over.set_result(error)

        out.hold_source(self.response.pause_reading, self.response.resume_reading)
        self.response.pipe(relay, ended)
        error = await over
        if error is not None:
            self.end = "stream_error"
            out.write(_stream_error(self.api, f"upstream replica failed mid-stream: {type(error).__name__}"))
        elif not self.api.stream_complete(self._tail()) and self.response.content_type == "text/event-stream":
            self.end = "stream_error"
            out.write(_stream_error(self.api, "upstream replica ended the stream early"))
        else:
            self.end = "ok"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        end = self.end
        if end == "ok":
            self.response.release()
        else:
            self.response.close()
        tail = self._tail()
        if end == "client_disconnect" and self.api.stream_complete(tail):
            end = "ok"
        usage = self.api.usage_of_stream_tail(tail) if end == "ok" else None
        self.on_end(StreamResult(end, usage, time.monotonic()))

    def _tail(self) -> bytes:
        return self._prev[-TAIL_BYTES:] + self._last


def _stream_error(api: Api, message: str) -> bytes:
    return api.errors.stream_events(ApiError(502, message, code="upstream_stream_error"))
