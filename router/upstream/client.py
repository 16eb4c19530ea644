"""HTTP/1.1 to the engines: a keep-alive connection pool per origin, one exchange at a time on each connection.

Every request the gateway sends an engine goes through :class:`EngineClient`: proxied requests, handoff legs, metric
scrapes, health probes. It does what a proxy to engines needs and nothing else: requests with a body written in one
``write``, answers parsed by httptools (llhttp, the parser uvicorn uses on the server side) and handed over as they
arrive, whole (:meth:`EngineResponse.read`) or chunk by chunk (:meth:`EngineResponse.readany`), connections kept
alive and reused most-recent first.

Why not aiohttp's ``ClientSession``: on a short proxied request it spent ~0.14 ms of CPU per request (its URL and
header objects, request and response wrappers, timers and tracing hooks), more than the rest of the proxy hop
together (docs/benchmarks.md, "Router overhead"). This client parses no URL but the origin, keeps headers as a list
of lower-case pairs, and arms one timer per request.

What it guarantees:

- **Framing is the parser's**: Content-Length, chunked and read-until-close bodies, 1xx answers skipped; anything
  malformed fails the exchange (:class:`UpstreamDisconnected`) and closes the connection. A connection is reused only
  when its answer ended cleanly and the engine did not ask to close.
- **Header injection is impossible**: a header name or value holding CR, LF or NUL is a :class:`ValueError` before
  anything is written.
- **Backpressure**: a response buffers at most :data:`HIGH_WATER_BYTES` before the connection stops reading, until
  the reader catches up, so a slow client slows its engine's socket instead of growing the gateway's memory.
- **Every connection is accounted for**: at most ``max_per_origin`` per origin (requests wait beyond that), idle
  ones closed after ``keepalive_s``, and an answer abandoned before its end (:meth:`EngineResponse.close`, a cancelled
  read, a deadline) closes its connection, which is how the engine learns to abort the sequence.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httptools

HIGH_WATER_BYTES = 256 * 1024
"""A response's unread bytes above which its connection stops reading from the engine."""
LOW_WATER_BYTES = 64 * 1024
"""...and below which it reads again."""
_FORBIDDEN_IN_HEADERS = re.compile(r"[\r\n\0]")


class UpstreamError(Exception):
    """An exchange with an engine failed."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made: refused, unreachable, or not within the connect timeout."""


class UpstreamDisconnected(UpstreamError):
    """The connection ended, or the engine sent something that is not HTTP, before the answer was complete."""


class UpstreamBodyTooLarge(UpstreamError):
    """An answer read whole was larger than the caller allows."""


ANSWER_HEAD_MAX_BYTES = 64 * 1024
"""The most an answer's status line and headers may hold: an engine (or whatever answers at its URL) sending more
fails the attempt rather than growing the gateway's memory for as long as it sends."""
FETCH_MAX_BYTES = 16 * 1024 * 1024
"""The largest answer :meth:`EngineClient.fetch` reads by default."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """An answer read whole (:meth:`EngineClient.fetch`)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        return next((value for key, value in self.headers if key == name), None)


class EngineResponse:
    """One answer: its status and headers once they have arrived, its body as it arrives.

    Read it whole (:meth:`read`) or chunk by chunk (:meth:`readany`), or piped (:meth:`pipe`); then :meth:`release` it (its
    connection goes back to the pool when the answer was complete) or :meth:`close` it (abandoned: its connection is
    closed). A read after the connection failed raises :class:`UpstreamDisconnected`, or :class:`TimeoutError` when
    the request's total deadline passed."""

    __slots__ = ("status", "headers", "_connection", "_chunks", "_buffered", "_complete", "_error", "_waiter",
                 "_deadline", "_extend", "_reads_until_close", "_sink", "_on_end", "_piped")

    def __init__(self, connection: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        """The answer's headers in order, names in lower case."""
        self._connection: _Connection | None = connection
        """The connection the answer arrives on; None once it is complete or abandoned."""
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._extend: Callable[[], float | None] | None = None
        """Asked when the deadline passes: seconds more to wait, or None to fail (:meth:`set_timeout`)."""
        self._reads_until_close = False
        self._sink: Callable[[bytes], None] | None = None
        """Where chunks go as they arrive once the answer is piped (:meth:`pipe`)."""
        self._on_end: Callable[[BaseException | None], None] | None = None
        self._piped: list[bytes] = []
        """A piped answer's chunks from the read in progress, for the sink at the read's end (:meth:`_flush`)."""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def content_type(self) -> str:
        """The media type, without parameters, in lower case ("" when the answer names none)."""
        value = self.header("content-type")
        return value.split(";", 1)[0].strip().lower() if value else ""

    @property
    def complete(self) -> bool:
        """Whether the whole answer has arrived (some of it may still be unread)."""
        return self._complete

    async def readany(self) -> bytes:
        """What has arrived and not been read, waiting for some when nothing has; b"" once the answer is over."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            await self._wait()
        data = b"".join(self._chunks)  # one chunk is handed over as it is: joining one bytes object returns it
        self._chunks.clear()
        self._drained()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (what is left of it). Beyond ``limit`` bytes the connection is closed and
        :class:`UpstreamBodyTooLarge` raised."""
        parts: list[bytes] = []
        size = 0
        while True:
            if self._chunks:
                parts.extend(self._chunks)
                size += self._buffered
                self._chunks.clear()
                self._drained()
                if limit is not None and size > limit:
                    self.close()
                    raise UpstreamBodyTooLarge(f"the answer is larger than {limit} bytes")
            if self._complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self._error is not None:
                raise self._error
            await self._wait()

    def pipe(self, sink: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]) -> None:
        """From now on hand the answer's chunks to ``sink`` as they arrive, from the connection's own callback (no
        reader woken, nothing buffered), those already in first; then ``on_end(None)`` at its end, or
        ``on_end(error)`` when it fails (a lost connection, the deadline, an abandon). A relay's way to read: a chunk
        costs a call, not a task switch. The chunks one read from the engine's socket brings go to ``sink`` as one:
        an engine's events that queued while the gateway was busy leave in one write, not one each.
        :meth:`pause_reading` holds the chunks back while ``sink`` cannot take more."""
        chunks, self._chunks = list(self._chunks), deque()
        self._drained()
        if chunks:
            sink(b"".join(chunks))  # one chunk is handed over as it is: joining one bytes object returns it
        if self._complete or self._error is not None:
            on_end(self._error)
            return
        self._sink = sink
        self._on_end = on_end

    def pause_reading(self) -> None:
        """Stop reading the answer from the engine until :meth:`resume_reading` (a piped answer's backpressure)."""
        if self._connection is not None:
            self._connection.pause()

    def resume_reading(self) -> None:
        if self._connection is not None:
            self._connection.resume()

    def release(self) -> None:
        """Done with the answer: a complete one has given its connection back already; one still arriving is
        abandoned (:meth:`close`)."""
        if not self._complete:
            self.close()

    def close(self) -> None:
        """Abandon the answer: its connection is closed unless the answer was complete."""
        connection = self._connection
        if not self._complete and self._error is None:
            self._fail(UpstreamDisconnected("the answer was abandoned"))
        if connection is not None:
            connection.abandon(self)
        self._chunks.clear()
        self._buffered = 0

    def __del__(self) -> None:
        # Dropped while its answer was still arriving (by a caller cancelled at the wrong moment): its connection can
        # never be reused, and must not be counted open forever.
        connection = self._connection
        if connection is not None:
            connection.abandon(self)

    # called by the connection

    def _head(self, status: int, headers: list[tuple[str, str]], reads_until_close: bool) -> None:
        self.status = status
        self.headers = headers
        self._reads_until_close = reads_until_close
        self._wake()

    def _feed(self, data: bytes) -> None:
        if self._sink is not None:
            self._piped.append(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _finish(self) -> None:
        if self._error is not None:
            return  # failed already (a deadline, an abandon): what arrives after that is not an answer
        self._complete = True
        self._connection = None
        self._cancel_deadline()
        self._wake()
        self._ended(None)

    def _fail(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._connection = None
        self._cancel_deadline()
        self._wake()
        self._ended(error)

    def _flush(self) -> None:
        """The read from the engine's socket is over: what it brought of a piped answer goes to the sink."""
        piped = self._piped
        if piped:
            data = b"".join(piped)
            piped.clear()
            if self._sink is not None:
                self._sink(data)

    # internals

    def _ended(self, error: BaseException | None) -> None:
        self._flush()
        on_end, self._on_end = self._on_end, None
        self._sink = None
        if on_end is not None:
            on_end(error)

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        except BaseException:  # cancelled while waiting: the answer cannot be read to its end by anyone
            self.close()
            raise
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _drained(self) -> None:
        self._buffered = 0
        if self._connection is not None:
            self._connection.resume()

    def set_timeout(self, timeout_s: float | None, extend: Callable[[], float | None] | None = None) -> None:
        """From now, the rest of the answer must arrive within ``timeout_s`` (None: no deadline): past it, reads raise
        :class:`TimeoutError` and the connection is closed. ``extend``, when given, is asked as the deadline passes
        and may put it off by the seconds it returns (None: the deadline stands). Replaces the deadline the request
        set, and its extension."""
        self._cancel_deadline()
        self._extend = extend
        if timeout_s is not None and not self._complete and self._error is None:
            self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._extend is not None:
            more_s = self._extend()
            if more_s is not None and more_s > 0:
                self._deadline = asyncio.get_running_loop().call_later(more_s, self._deadline_passed)
                return
        connection = self._connection
        self._fail(TimeoutError("the engine did not answer in time"))
        if connection is not None:
            connection.abandon(self)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin, parsing the answer of the exchange in progress."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: EngineResponse | None = None
        self.exchanges = 0
        """Requests sent on this connection: one that fails on a reused connection before any answer may be sent
        again (:meth:`EngineClient.request`)."""
        self.answering = False
        """Whether any of the current exchange's answer has arrived."""
        self.idle_since = 0.0
        self.closed = False
        self._headers: list[tuple[str, str]] = []
        self._informational = False
        self._paused = False
        self._head_room: int | None = None
        """Bytes the current answer's head may still take; None once its final head is complete."""

    # asyncio protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # streamed chunks never wait for Nagle

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: an engine talking out of turn is not to be trusted
            self.abort()
            return
        self.answering = True
        room = self._head_room
        if room is not None:
            if len(data) > room:
                # Feed only what the head may still take: if it is not complete within that, it is too large.
                if not self._feed(data[:room]):
                    return
                if self._head_room is not None:
                    self._failed(UpstreamDisconnected(
                        f"the engine's answer head exceeds {ANSWER_HEAD_MAX_BYTES} bytes"))
                    return
                data = data[room:]
            else:
                self._head_room = room - len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """Hand ``data`` to the parser, then what it held of the answer's body to a piped answer's sink; False when
        the answer failed for what it held."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._failed(UpstreamDisconnected(f"the engine's answer is not valid HTTP: {e}"))
            return False
        if self.response is not None:
            self.response._flush()
        return True

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost says what it means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response, self.response = self.response, None
        if response is not None:
            if response.status and response._reads_until_close and not self._informational:
                response._finish()  # its body was everything until the close
            else:
                reason = f": {exc}" if exc is not None else ""
                response._fail(UpstreamDisconnected(f"the engine closed the connection before its answer ended{reason}"))
        self.pool.lost(self)

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.response is None:
            raise UpstreamDisconnected("the engine sent an answer nothing asked for")
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._informational = 100 <= status < 200
        if self._informational or self.response is None:
            return
        self._head_room = None
        headers = self._headers
        until_close = not any(name in ("content-length", "transfer-encoding") for name, _ in headers)
        self.response._head(status, headers, until_close)

    def on_body(self, body: bytes) -> None:
        if self.response is not None and not self._informational:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        response, self.response = self.response, None
        if response is None:
            return
        response._finish()
        self.resume()
        if self.parser.should_keep_alive() and not self.closed:
            self.pool.give_back(self)
        else:
            self.abort()

    # the exchange

    def send(self, head: bytes, body: bytes, response: EngineResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.exchanges += 1
        self.answering = False
        self._head_room = ANSWER_HEAD_MAX_BYTES
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abandon(self, response: EngineResponse) -> None:
        """``response`` is given up before its end: it is no longer this connection's, and the connection closes."""
        if self.response is response:
            self.response = None
        self.abort()

    def abort(self) -> None:
        """Close at once (an answer abandoned mid-way cannot be read past; the engine sees the close)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    def _failed(self, error: UpstreamError) -> None:
        response, self.response = self.response, None
        if response is not None:
            response._fail(error)
        self.abort()


class _Pool:
    """The connections to one origin: idle ones most-recent first, at most ``limit`` open, requests waiting in
    order beyond that."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, limit: int, keepalive_s: float) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.host_header = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.idle: deque[_Connection] = deque()
        self.open = 0
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()

    async def acquire(self, connect_timeout_s: float, deadline: float | None, *, fresh: bool = False) -> _Connection:
        """An idle connection (unless ``fresh``), else a new one once fewer than ``limit`` are open; waiting for room
        and connecting end at ``deadline`` (the loop's clock) at the latest (:class:`TimeoutError`)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.idle and not fresh:
            connection = self.idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_s:
                return connection
            connection.abort()
        while self.open >= self.limit:
            waiter: asyncio.Future[_Connection | None] = loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    handed = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    handed = waiter.result()
                    if handed is not None:
                        self.give_back(handed)  # handed a connection just as it was cancelled: pass it on
                    else:
                        self._wake_one()  # woken to connect just as it was cancelled: the next one may
                raise
            if handed is not None and not fresh:
                return handed
            if handed is not None:
                handed.abort()  # its close makes the room this request needs (``lost``)
        self.open += 1
        made: list[_Connection] = []

        def connection() -> _Connection:
            made.append(_Connection(self))
            return made[0]

        connect_by = loop.time() + connect_timeout_s
        try:
            async with asyncio.timeout_at(connect_by if deadline is None else min(connect_by, deadline)):
                await loop.create_connection(connection, self.host, self.port, ssl=self.tls,
                                             server_hostname=self.host if self.tls is not None else None)
        except BaseException as e:
            if made and made[0].transport is not None:
                made[0].abort()  # connected after all: its close is counted when it is lost
            else:
                self._closed_one()
            if isinstance(e, TimeoutError) and (deadline is None or loop.time() < deadline):
                raise UpstreamConnectError(
                    f"no connection to {self.host_header} within {connect_timeout_s:g} s") from e
            if isinstance(e, OSError):
                raise UpstreamConnectError(f"cannot connect to {self.host_header}: {e}") from e
            raise
        return made[0]

    def give_back(self, connection: _Connection) -> None:
        """A connection whose exchange ended cleanly: to the next waiting request, else idle."""
        if connection.closed:
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = now = asyncio.get_running_loop().time()
        self.idle.append(connection)
        oldest = self.idle[0]
        if now - oldest.idle_since >= self.keepalive_s:
            self.idle.popleft()
            oldest.abort()

    def lost(self, connection: _Connection) -> None:
        """A connection closed (by either end): it no longer counts, and a waiting request may open one."""
        try:
            self.idle.remove(connection)
        except ValueError:
            pass
        self._closed_one()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()

    def _closed_one(self) -> None:
        self.open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # room to open a connection
                return


KEEPALIVE_S = 4.0
"""How long an idle connection is reused: less than the 5 s after which the engines' servers (uvicorn's default,
which vLLM and SGLang keep) close idle connections themselves, so a request is rarely written to a connection the
engine is closing at that moment."""


class EngineClient:
    """Connection pools to every origin the gateway sends requests to (``http://`` or ``https://``)."""

    def __init__(self, max_per_origin: int, keepalive_s: float = KEEPALIVE_S, tls: ssl.SSLContext | None = None) -> None:
        self.max_per_origin = max_per_origin
        self.keepalive_s = keepalive_s
        self.tls = tls
        """The TLS settings of ``https://`` origins (the system's trusted CAs when None)."""
        self._pools: dict[str, _Pool] = {}
        self._closed = False

    async def request(
        self, method: str, url: str, headers: Mapping[str, str] | None = None, body: bytes = b"", *,
        connect_timeout_s: float, timeout_s: float | None = None, on_sent: Callable[[], None] | None = None,
        extend: Callable[[], float | None] | None = None,
    ) -> EngineResponse:
        """Send a request and return its answer once its status and headers have arrived (its body follows).
        ``timeout_s`` bounds the exchange, connecting and the body included, until the caller sets another
        (:meth:`EngineResponse.set_timeout`): past it, this or a read raises :class:`TimeoutError` and the connection
        is closed, unless ``extend`` puts it off once the request is sent (a connection waited for is not). Raises
        :class:`UpstreamConnectError`, :class:`UpstreamDisconnected`, or :class:`ValueError` for a URL or header that
        cannot be sent. ``on_sent`` is called once the request is handed to its connection,
        before its answer is awaited (what the request leaves behind is recorded while the engine works).

        A request written to a kept-alive connection that closes before any of its answer arrived is sent once more,
        on a new connection: that is the engine closing an idle connection as the request went out (nothing was
        run), not a failure of the request."""
        if self._closed:
            raise UpstreamConnectError("the client is closed")
        origin, target = split_url(url)
        pool = self._pools.get(origin) or self._pool(origin)
        head = request_head(method, target, pool.host_header, headers, body)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        fresh = False
        while True:
            connection = await pool.acquire(connect_timeout_s, deadline, fresh=fresh)
            response = EngineResponse(connection)
            if deadline is not None:
                response.set_timeout(max(0.0, deadline - loop.time()), extend)
            connection.send(head, body, response)
            if on_sent is not None:
                on_sent()
                on_sent = None
            try:
                while not response.status:
                    if response._error is not None:
                        raise response._error
                    await response._wait()
            except UpstreamDisconnected:
                if fresh or connection.exchanges < 2 or connection.answering:
                    raise
                fresh = True
                continue
            except BaseException:
                response.close()
                raise
            return response

    async def fetch(
        self, method: str, url: str, headers: Mapping[str, str] | None = None, body: bytes = b"", *,
        timeout_s: float, max_bytes: int = FETCH_MAX_BYTES,
    ) -> Fetched:
        """A whole exchange within ``timeout_s`` (connecting included), its body read whole within ``max_bytes``:
        what the gateway asks engines for itself (metrics, health, models, stored responses). Raises
        :class:`UpstreamError` (:class:`UpstreamBodyTooLarge` beyond ``max_bytes``), :class:`TimeoutError`, or
        :class:`ValueError` for a URL or header that cannot be sent."""
        response = await self.request(method, url, headers, body, connect_timeout_s=timeout_s, timeout_s=timeout_s)
        try:
            return Fetched(response.status, response.headers, await response.read(max_bytes))
        finally:
            response.release()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def _pool(self, origin: str) -> _Pool:
        scheme, _, hostport = origin.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme {scheme!r}")
        host, port = split_hostport(hostport, 443 if scheme == "https" else 80)
        tls = (self.tls or ssl.create_default_context()) if scheme == "https" else None
        pool = self._pools[origin] = _Pool(host, port, tls, self.max_per_origin, self.keepalive_s)
        return pool


def split_url(url: str) -> tuple[str, str]:
    """``scheme://host:port`` and the request target (path and query, "/" at least) of an absolute URL."""
    start = url.find("://")
    if start <= 0:
        raise ValueError(f"not an absolute URL: {url!r}")
    end = len(url)
    for mark in "/?":
        at = url.find(mark, start + 3)
        if 0 <= at < end:
            end = at
    target = url[end:]
    return url[:end], target if target.startswith("/") else "/" + target


def split_hostport(hostport: str, default_port: int) -> tuple[str, int]:
    """Host and port of ``host[:port]`` (an IPv6 host in brackets)."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = hostport.rpartition(":")
    if not sep:
        return hostport, default_port
    return host, int(port)


def request_head(
    method: str, target: str, host: str, headers: Mapping[str, str] | None, body: bytes
) -> bytes:
    """The request line and headers, with Host and (when there is a body, or the method takes one) Content-Length."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    if headers:
        lines.extend(f"{name}: {value}" for name, value in headers.items())
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}")
    if _FORBIDDEN_IN_HEADERS.search("".join(lines)) or " " in target:
        raise ValueError("a request line or header holds a character HTTP does not allow there")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
