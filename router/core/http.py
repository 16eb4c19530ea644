"""A request and a streamed answer as kvgate's own HTTP server (:mod:`kvgate.router.app.protocol`) and its endpoints
share them: no ASGI messages, no framework objects on the request path.

The server starts an endpoint as soon as a request's headers are in, so an endpoint can refuse a request (a bad key,
a body declared too large) before its body is read; the body is fed to the :class:`HttpRequest` as it arrives and
read with :meth:`HttpRequest.chunks`, usually whole already by then. A client that leaves is told to the request,
which cancels the task it guards (:meth:`HttpRequest.guard`); what an endpoint answers is a Starlette ``Response``
(its status, headers and body are written as they are) or a :class:`StreamedAnswer`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol
from urllib.parse import parse_qs


class ClientLeft(Exception):
    """The client closed its connection before the request's body arrived in full."""


class MalformedBody(Exception):
    """The request's body broke HTTP's framing (a chunk size that is not hex, a chunk cut short): what arrived is
    not the body the client sent."""


class HttpRequest:
    """One request: method, path, query and headers as received (names in lower case), and its body as it arrives.

    ``route`` is the path template the server matched (``/v1/responses/{response_id}``), for span names."""

    __slots__ = ("method", "path", "query", "headers", "route", "params", "on_wait", "_chunks", "_fed", "_taken",
                 "_complete", "_waiter", "_left", "_guard", "_cancelled", "_malformed")

    def __init__(self, method: str, path: str, query: str, headers: list[tuple[bytes, bytes]], route: str = "",
                 params: Mapping[str, str] | None = None) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.route = route or path
        self.params: Mapping[str, str] = params or {}
        """The route's path parameters (``response_id``)."""
        self.on_wait: Callable[[], None] | None = None
        """Called each time a reader waits for more of the body (the server then reads again, and says ``100
        Continue`` to a client that waits for it)."""
        self._chunks: list[bytes] = []
        self._fed = 0
        self._taken = 0
        self._complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._left = False
        self._guard: asyncio.Task[object] | None = None
        self._cancelled = False
        self._malformed = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        key = name.encode("latin-1")
        for header, value in self.headers:
            if header == key:
                return value.decode("latin-1")
        return None

    def query_param(self, name: str) -> str | None:
        """The first value of query parameter ``name``, or None."""
        if not self.query:
            return None
        values = parse_qs(self.query, keep_blank_values=True).get(name)
        return values[0] if values else None

    @property
    def left(self) -> bool:
        """Whether the client has closed its connection."""
        return self._left

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived."""
        return self._complete

    def received(self) -> list[bytes]:
        """The body's chunks that have arrived (all of it once :attr:`complete`)."""
        return self._chunks

    @property
    def unread_bytes(self) -> int:
        """Body bytes that have arrived and that no reader has taken yet."""
        return self._fed - self._taken

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks, those already in first, then each as it arrives. Raises :class:`ClientLeft` when the
        client leaves first."""
        sent = 0
        while True:
            while sent < len(self._chunks):
                chunk = self._chunks[sent]
                sent += 1
                self._taken += len(chunk)
                yield chunk
            if self._complete:
                return
            if self._malformed:
                raise MalformedBody
            if self._left:
                raise ClientLeft
            if self.on_wait is not None:
                self.on_wait()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def guard(self) -> bool:
        """From now until :meth:`unguard`, the calling task is cancelled the moment the client leaves; False (and
        nothing guarded) when it has left already."""
        if self._left:
            return False
        self._guard = asyncio.current_task()
        return True

    def unguard(self) -> bool:
        """Stop guarding; True when the client's leaving cancelled the guarded task (which should then
        ``uncancel()``: the cancellation was this request's, not its caller's)."""
        self._guard = None
        fired, self._cancelled = self._cancelled, False
        return fired

    # called by the server

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._fed += len(chunk)
        self._wake()

    def finish(self) -> None:
        self._complete = True
        self._wake()

    def malformed(self) -> None:
        """The body broke HTTP's framing: a reader waiting for the rest raises :class:`MalformedBody`."""
        self._malformed = True
        self._wake()

    def leave(self) -> None:
        """The client closed its connection: a guarded wait is cancelled, a body still awaited raises."""
        if self._left:
            return
        self._left = True
        self._wake()
        if self._guard is not None and not self._cancelled:
            self._cancelled = True
            self._guard.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class BodyWriter(Protocol):
    """Where a streamed answer writes its body: the client's side of the connection, framed by the server."""

    def write(self, chunk: bytes) -> None:
        """Send ``chunk`` now (never waits: the server buffers what the client's socket cannot take yet)."""

    def hold_source(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """How to stop and restart what produces the chunks: called while the client's socket is full, so a slow
        client slows the source instead of growing the server's buffer."""


class StreamBody(Protocol):
    """A streamed answer's body: written to the client by :meth:`write_to`, released by :meth:`aclose`."""

    async def write_to(self, out: BodyWriter) -> None:
        """Write the whole body to ``out``, returning once it is written (cancelled when the client leaves)."""

    async def aclose(self) -> None:
        """Release what produces the body (an upstream connection), however the answer ended."""


class StreamedAnswer:
    """An answer whose body is written as it is produced (chunked), with its status and headers first. The server
    closes ``body`` (``aclose``) however the answer ends, so what it holds (an upstream connection) is released at
    once, and a client that leaves mid-stream cancels the writing."""

    __slots__ = ("status_code", "headers", "body")

    def __init__(self, status_code: int, headers: Mapping[str, str], body: StreamBody) -> None:
        self.status_code = status_code
        self.headers = headers
        self.body = body
