"""kvgate's HTTP/1.1 server: one :class:`HttpProtocol` per client connection, run by uvicorn's server.

uvicorn (``uvicorn.Server``) binds the socket, handles signals and shuts down gracefully; it takes a protocol class in
place of its own (``uvicorn.Config(http=...)``), and this is it. Every request goes straight to the endpoint its route
names (:class:`~kvgate.router.app.routes.Routes`) as an :class:`~kvgate.router.core.http.HttpRequest`. Why not
uvicorn's own protocol and ASGI: its request cycle, the ASGI messages and a framework's request and response objects
cost more CPU per proxied request than kvgate's whole routing decision (docs/benchmarks.md, "Router overhead").

What a connection may do is bounded, whatever arrives and however slowly:

- a request's line and headers are counted before the parser sees them, and refused (431, then closed) beyond
  ``max_header_bytes`` or ``max_headers`` lines; they must arrive within ``header_timeout_s`` of the connection
  opening, or of the request's first byte on a kept-alive connection (slowloris);
- a body must arrive in full within ``body_timeout_s`` of its headers (plus :data:`BODY_GRACE_S`, so the endpoint's
  own 408 goes out first), a deadline no trickle moves; while no endpoint reads it, at most
  :data:`UNREAD_BODY_BYTES` of it is taken in (each endpoint bounds what it reads: :mod:`kvgate.router.pipeline.bodies`);
- an answer sent before the request's body arrived in full (a refusal) says ``connection: close``; the connection
  then reads nothing more, shuts its write side once the answer is out and closes after :data:`LINGER_S` (nginx's
  lingering close: a client still sending gets the answer instead of a reset);
- an idle kept-alive connection closes after ``keep_alive_s``; pipelined requests are answered in order, one at a
  time, reading paused while one waits;
- malformed HTTP is answered 400 in OpenAI's error shape with a JSON content type, like every kvgate error, and an
  Upgrade is answered as plain HTTP, then the connection closed.

An answer's status line and headers go out in the same write as its first body bytes. A response, however long it
streams, is never cut by any of these deadlines; a client that leaves cancels the work its request guards
(:meth:`~kvgate.router.core.http.HttpRequest.guard`) and the stream it was being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import urllib.parse
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools

from kvgate.router.app.routes import Endpoint, Routes
from kvgate.router.core.errors import ApiError, unexpected_error
from kvgate.router.core.http import HttpRequest, StreamedAnswer

log = logging.getLogger(__name__)

BODY_GRACE_S = 1.0
"""The connection outlives the endpoint's own body deadline by this much, so its 408 is written before the close."""
LINGER_S = 2.0
"""After an early answer, the connection stays half-open this long (reading and dropping) before it is closed."""
UNREAD_BODY_BYTES = 65536
"""Body bytes taken in while no endpoint reads them; beyond this the connection stops reading until one does."""
STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}
STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"  # nginx's, for a client that left
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
NO_BODY_STATUSES = frozenset({204, 304})


def status_line(status: int) -> bytes:
    return STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


class _HeadersTooLarge(Exception):
    """Raised inside a parser callback: the request has more header lines than allowed."""


class _UnsupportedTransferCoding(Exception):
    """Raised from a parser callback: the request's body is in a transfer coding other than ``chunked`` (its bytes
    would reach the endpoint still coded)."""


class _Exchange:
    """One request on the connection and the state of its answer."""

    __slots__ = ("request", "keep_alive", "head_only", "expects_continue", "http_version", "started", "done")

    def __init__(self, request: HttpRequest, keep_alive: bool, head_only: bool, expects_continue: bool,
                 http_version: str) -> None:
        self.request = request
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.expects_continue = expects_continue
        self.http_version = http_version
        self.started = False
        """Whether the answer's head has been written."""
        self.done = False


class HttpProtocol(asyncio.Protocol):
    """One client connection. Constructed by uvicorn's server with its config and shared state (the connections and
    tasks it waits for at shutdown, the ``date`` header), and by ``functools.partial`` with everything else
    (:func:`kvgate.router.app.server.build_server`)."""

    def __init__(
        self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: asyncio.AbstractEventLoop | None = None,
        *, routes: Routes, header_timeout_s: float, body_timeout_s: float, max_header_bytes: int, max_headers: int,
        keep_alive_s: float,
    ) -> None:
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.routes = routes
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.keep_alive_s = keep_alive_s
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # answer the first of pipelined requests sent after a close
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._deadline: asyncio.TimerHandle | None = None
        """The one timer in force: the headers', the body's, the idle keep-alive's, or the linger's."""
        self._lingering = False
        self._read_paused = False
        self._write_paused = False
        """Whether the transport's write buffer is full (the client reads slower than its answer comes)."""
        self._source: tuple[Callable[[], None], Callable[[], None]] | None = None
        """How to pause and resume what produces the streamed answer being written (:class:`_ChunkWriter`)."""
        # the request being parsed
        self._reading_headers = True
        self._header_bytes = 0
        self._header_count = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._parsing: _Exchange | None = None
        """The request whose body is being parsed."""
        # the requests of this connection
        self._current: _Exchange | None = None
        """The request being answered."""
        self._queued: deque[_Exchange] = deque()
        """Pipelined requests waiting for it."""

    # asyncio protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)
        self._arm(self.header_timeout_s, self._headers_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._disarm()
        for exchange in (self._current, *self._queued, self._parsing):
            if exchange is not None:
                exchange.request.leave()
        self._queued.clear()

    def eof_received(self) -> bool | None:
        return None  # a client that half-closes is gone: nothing more can be answered to it usefully

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._source is not None:
            self._source[0]()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._source is not None:
            self._source[1]()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is out and the request is not wanted: dropped until the linger ends
        if self._reading_headers:
            room = self.max_header_bytes - self._header_bytes
            if len(data) > room:
                # Feed only what the headers may still take: if they are not complete within it, they are too large
                # (never hand the parser more, it would buffer all of it). The rest is body or the next request.
                head, data = data[:room], data[room:]
                self._header_bytes += len(head)
                if not self._feed(head):
                    return
                if self._reading_headers:
                    self._refuse(431, f"the request line and headers exceed {self.max_header_bytes} bytes",
                                 "request_header_fields_too_large")
                    return
            else:
                self._header_bytes += len(data)
        self._feed(data)

    # httptools parser callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        if self._current is None or self._deadline is None:  # replaces the idle timer
            self._arm(self.header_timeout_s, self._headers_timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise _HeadersTooLarge
        name = name.lower()
        if name == b"transfer-encoding" and any(coding.strip().lower() != b"chunked" for coding in value.split(b",")):
            raise _UnsupportedTransferCoding
        self._headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        parser = self.parser
        method = parser.get_method().decode("ascii")
        http_version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        path = url.path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        query = url.query.decode("latin-1") if url.query else ""
        headers = self._headers
        request = HttpRequest(method, path, query, headers)
        expects_continue = http_version == "1.1" and (b"expect", b"100-continue") in (
            (name, value.lower()) for name, value in headers if name == b"expect")
        keep_alive = parser.should_keep_alive() and not parser.should_upgrade()
        exchange = _Exchange(request, keep_alive, method == "HEAD", expects_continue, http_version)
        self._parsing = exchange
        if self._current is None:
            self._arm(self.body_timeout_s + BODY_GRACE_S, self._close)
            self._start(exchange)
        else:
            self._disarm()
            self._queued.append(exchange)  # answered after the one in progress
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self._parsing
        if exchange is None:
            return
        request = exchange.request
        request.feed(body)
        if request.unread_bytes > UNREAD_BODY_BYTES:
            self._pause_reading()  # until a reader waits for more (``_reading``)

    def on_message_complete(self) -> None:
        self._reading_headers = True  # what follows is the next request's head, counted from its first byte
        self._header_bytes = 0
        self._header_count = 0
        exchange, self._parsing = self._parsing, None
        if exchange is None:
            return
        exchange.request.finish()
        if exchange is self._current:
            self._disarm()

    # answering

    def _start(self, exchange: _Exchange) -> None:
        self._current = exchange
        request = exchange.request
        request.on_wait = functools.partial(self._reading, exchange)
        endpoint, request.route, request.params = self.routes.resolve(request.method, request.path)
        task = self.loop.create_task(self._serve(exchange, endpoint))
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _reading(self, exchange: _Exchange) -> None:
        """An endpoint waits for the body: say ``100 Continue`` if the client waits for that, read again if paused."""
        if exchange.expects_continue and not exchange.started and not self.transport.is_closing():
            exchange.expects_continue = False
            self.transport.write(CONTINUE)
        self._resume_reading()

    async def _serve(self, exchange: _Exchange, endpoint: Endpoint) -> None:
        try:
            answer = await endpoint(exchange.request)
        except ApiError as e:
            answer = e.response()
        except Exception as e:  # noqa: BLE001 - a bug must still get an answer
            answer = unexpected_error(e)
        if isinstance(answer, StreamedAnswer):
            await self._stream(exchange, answer)
        else:
            self._write_whole(exchange, answer.status_code, answer.raw_headers, answer.body)

    async def _stream(self, exchange: _Exchange, answer: StreamedAnswer) -> None:
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers.items()]
        chunked = exchange.http_version == "1.1"
        if chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        else:
            exchange.keep_alive = False  # an HTTP/1.0 client reads a stream to the close
        writer = _ChunkWriter(self, self._head(exchange, answer.status_code, headers), chunked)
        request = exchange.request
        try:
            if request.guard():  # a client that leaves stops the stream at once
                await answer.body.write_to(writer)
                writer.finish()
                request.unguard()
        except asyncio.CancelledError:
            if not request.unguard():
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            self._source = None
            await answer.body.aclose()
        self._finished(exchange)

    def _write_whole(self, exchange: _Exchange, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if not self.transport.is_closing():
            head = self._head(exchange, status, headers)
            if body and not exchange.head_only and status not in NO_BODY_STATUSES:
                self.transport.writelines((head, body))
            else:
                self.transport.write(head)
        self._finished(exchange)

    def _head(self, exchange: _Exchange, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The status line and headers; an answer that starts before the request's body arrived in full closes the
        connection after it (said here), as does one to a request that asked for that."""
        exchange.started = True
        if not exchange.request.complete:
            exchange.keep_alive = False
        lines = [status_line(status)]
        lines.extend(b"%b: %b\r\n" % header for header in headers)
        lines.extend(b"%b: %b\r\n" % header for header in self.server_state.default_headers)
        if not exchange.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _finished(self, exchange: _Exchange) -> None:
        """The answer is out: the next pipelined request, or the idle timer; a connection not kept alive closes
        (lingering when the request's body never arrived in full)."""
        # The request's callback holds the exchange, which holds the request: cleared, refcounting frees both and
        # the cycle collector has no per-request garbage to find.
        exchange.request.on_wait = None
        if exchange.done:
            return
        exchange.done = True
        self.server_state.total_requests += 1
        if self._current is exchange:
            self._current = None
        if self.transport.is_closing():
            return
        if not exchange.keep_alive:
            if not exchange.request.complete:
                self._linger()
            else:
                self._queued.clear()
                self.transport.close()
            return
        if self._queued:
            following = self._queued.popleft()
            if not following.request.complete:
                self._arm(self.body_timeout_s + BODY_GRACE_S, self._close)
            self._resume_reading()
            self._start(following)
            return
        self._resume_reading()
        if self._parsing is None and self._header_bytes == 0:  # idle: no next request has begun to arrive
            self._arm(self.keep_alive_s, self._close)

    # uvicorn's server

    def shutdown(self) -> None:
        """Graceful shutdown: close an idle connection now, a busy one after its answer."""
        if self._current is None:
            self._close()
        else:
            self._current.keep_alive = False
            self._queued.clear()

    # internals

    def _feed(self, data: bytes) -> bool:
        """Hand ``data`` to the parser; False when the connection was refused for what it held."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # kvgate upgrades to nothing: the request is answered as plain HTTP and the connection closed after it.
            if self._parsing is not None:
                self._parsing.keep_alive = False
        except httptools.HttpParserError as e:
            exchange = self._parsing
            if isinstance(e.__context__, _HeadersTooLarge):
                self._refuse(431, f"the request has more than {self.max_headers} header lines",
                             "request_header_fields_too_large")
            elif isinstance(e.__context__, _UnsupportedTransferCoding):
                self._refuse(501, "the only transfer coding kvgate reads is chunked", "unsupported_transfer_coding")
            elif exchange is not None and exchange is self._current and not exchange.started:
                # The body of the request being answered broke its framing: that request's endpoint answers 400 in
                # its API's shape when it reads the body, and the connection closes after it.
                log.info("refused a request body: malformed HTTP framing")
                self._parsing = None
                self._lingering = True  # read nothing more
                exchange.keep_alive = False
                exchange.request.malformed()
            else:
                self._refuse(400, "malformed HTTP request", "invalid_http_request")
            return False
        return True

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error shape and close (lingering), unless an answer is already being
        written on this connection: then close at once."""
        log.info("refused a connection: %s", message)
        if self._current is not None:  # an answer is due on this connection first: it cannot be interleaved
            self._close()
            return
        self._parsing = None
        body = ApiError(status, message, code=code).encoded()
        self.transport.write(b"".join([
            status_line(status), b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body,
        ]))
        self._linger()

    def _linger(self) -> None:
        """Read nothing more from this connection: shut its write side once the answer is out, drop what still
        arrives, and close it after :data:`LINGER_S` (at once if the client closes first)."""
        self._lingering = True
        self._resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_S, self._close)

    def _close(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _headers_timed_out(self) -> None:
        """A request's headers did not arrive in time: close, but after the answer being written, if one is (a
        pipelined request's headers do not cut a stream short)."""
        log.debug("closing a connection whose request headers did not arrive within %.1f s", self.header_timeout_s)
        current = self._current
        if current is not None and not current.done:
            current.keep_alive = False
            self._parsing = None
            self._queued.clear()
            self._lingering = True  # read nothing more
            return
        self._close()

    def _pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class _ChunkWriter:
    """A streamed answer's body as the connection writes it: each chunk framed (chunked transfer coding for HTTP/1.1)
    and written at once, the status line and headers with the first; its source paused while the client's socket is
    full."""

    __slots__ = ("protocol", "transport", "head", "chunked")

    def __init__(self, protocol: HttpProtocol, head: bytes, chunked: bool) -> None:
        self.protocol = protocol
        self.transport = protocol.transport
        self.head = head
        self.chunked = chunked

    def write(self, chunk: bytes) -> None:
        if not chunk or self.transport.is_closing():
            return
        framed = b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk
        if self.head:
            self.transport.writelines((self.head, framed))
            self.head = b""
        else:
            self.transport.write(framed)

    def hold_source(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self.protocol._source = (pause, resume)
        if self.protocol._write_paused:
            pause()

    def finish(self) -> None:
        """The body is over: its end (and the head, for a body that had no bytes)."""
        if not self.transport.is_closing():
            self.transport.write(self.head + (b"0\r\n\r\n" if self.chunked else b""))
            self.head = b""
