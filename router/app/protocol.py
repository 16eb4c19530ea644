"""uvicorn's httptools protocol with the bounds uvicorn lacks: header size and count, and deadlines no trickle resets.

uvicorn (0.54, read in ``uvicorn/protocols/http/httptools_impl.py``) bounds only an idle connection between requests
(``timeout_keep_alive``), and even that timer is cancelled by every byte received (``data_received`` starts with
``_unset_keepalive_if_required``). So, without this protocol:

- a request's line and headers may take forever to arrive, a byte at a time (slowloris);
- they may be any size and count: httptools accumulates a header by concatenating its pieces (quadratic in the
  pieces), and a 64 MiB header held the event loop for seconds before the app saw the request;
- once the app has answered without reading the body (a 401 before the body, ``GET /health`` with a body), the
  parser goes on reading and dropping the body for as long as the client trickles it: the connection never closes.

This subclass of uvicorn's ``HttpToolsProtocol`` (passed to ``uvicorn.Config(http=...)``, which takes a protocol
class in place of a name) overrides only its public callbacks, and:

- counts the bytes of each request's line and headers before the parser sees them, and answers 431 (and closes)
  beyond ``max_header_bytes``, or beyond ``max_headers`` header lines;
- closes a connection whose request line and headers have not arrived within ``header_timeout_s`` of the connection
  opening, or of the request's first byte on a kept-alive connection (Go's ``ReadHeaderTimeout``, nginx's
  ``client_header_timeout``);
- closes a connection whose body has not arrived in full within ``body_timeout_s`` of its headers (plus
  :data:`BODY_GRACE_S`, so the app's own 408 for the same deadline goes out first); the deadline is fixed when the
  headers arrive, so no trickle moves it;
- after an answer sent before the body arrived in full (which says ``connection: close``), stops reading the request:
  the write side is shut and the connection closed after :data:`LINGER_S` (nginx's lingering close: a client still
  sending gets the answer instead of a reset), whatever the client sends meanwhile;
- answers the parser's own errors (a malformed request) in OpenAI's error shape with a JSON content type, like every
  other kvgate error, instead of uvicorn's plain text;
- writes each answer's status line and headers together with its first body bytes (:class:`HeadWithBody`).

A response, however long it streams, is never cut by any of these deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvgate.router.core.errors import ApiError

log = logging.getLogger(__name__)

BODY_GRACE_S = 1.0
"""The connection outlives the app's own body deadline by this much, so its 408 is written before the close."""
LINGER_S = 2.0
"""After an early answer, the connection stays half-open this long (reading and dropping) before it is closed."""


class _HeadersTooLarge(Exception):
    """Raised inside a parser callback: the request has more header lines than allowed."""


class BoundedHttpProtocol(HttpToolsProtocol):
    def __init__(
        self, *args: Any, header_timeout_s: float, body_timeout_s: float, max_header_bytes: int, max_headers: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self._deadline: asyncio.TimerHandle | None = None
        """The one deadline in force: the headers' (while they arrive), the body's, or the linger's."""
        self._reading_headers = True
        self._header_bytes = 0
        self._header_count = 0
        self._body_pending: Any = None
        """The request cycle whose body has not arrived in full (only the latest request can be one)."""
        self._lingering = False

    # asyncio protocol callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, self._headers_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is out and the body is not wanted: dropped until the linger ends
        self._unset_keepalive_if_required()
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

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "malformed HTTP request", "invalid_http_request")

    # httptools parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_bytes = 0
        self._header_count = 0
        if self._deadline is None:  # a fresh connection's header deadline is already armed
            self._arm(self.header_timeout_s, self._headers_timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise _HeadersTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._arm(self.body_timeout_s + BODY_GRACE_S, self._body_timed_out)
        previous = self.cycle
        super().on_headers_complete()
        self._body_pending = self.cycle
        if self.cycle is not None and self.cycle is not previous:
            self._wrap_send(self.cycle)

    def on_message_complete(self) -> None:
        self._body_pending = None
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pending = self._body_pending
        if pending is None or not pending.response_complete or self.transport.is_closing():
            super().on_response_complete()
            return
        # Answered before the body arrived in full: nothing more is read from this connection.
        self.server_state.total_requests += 1
        self._linger()

    # internals

    def _wrap_send(self, cycle: Any) -> None:
        """The ``send`` and transport the cycle's answer goes out through (its task has not started yet, so the app
        is passed this ``send``):

        - The status line and headers are held and written with the answer's first body bytes: one write, so one
          ``send`` syscall, instead of two for every answer (:class:`HeadWithBody`).
        - An answer that starts before its request's body arrived in full says ``connection: close``: the
          connection lingers and closes after it (:meth:`on_response_complete`), and a client told nothing reuses it
          for its next request, which the close then cuts off (httpx: "Server disconnected without sending a
          response"). uvicorn's own close when the answer ends is held back for the linger's: closing with the body
          unread would reset the connection, and the answer with it.
        """
        send = cycle.send
        transport = cycle.transport = HeadWithBody(cycle.transport)

        async def sending(message: Any) -> None:
            early = self._body_pending is cycle
            if message["type"] == "http.response.start":
                if early:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
                transport.holding = True
                try:
                    await send(message)
                finally:
                    transport.holding = False
                return
            if early and message["type"] == "http.response.body" and not message.get("more_body", False):
                cycle.keep_alive = True
            await send(message)
            transport.flush()  # an answer that wrote no body bytes (HEAD): its head goes now

        cycle.send = sending

    def _feed(self, data: bytes) -> bool:
        """Hand ``data`` to the parser; False when the connection was refused for what it held."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # kvgate upgrades to nothing (uvicorn runs with ``ws="none"``): the request is answered as plain HTTP
            # and the connection closed after it.
            if self.cycle is not None:
                self.cycle.keep_alive = False
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadersTooLarge):
                self._refuse(431, f"the request has more than {self.max_headers} header lines",
                             "request_header_fields_too_large")
            else:
                self._refuse(400, "malformed HTTP request", "invalid_http_request")
            return False
        return True

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error shape and close (lingering), unless a response is already being
        written on this connection (a pipelined request's): then close at once."""
        log.info("refused a connection: %s", message)
        if self.cycle is not None and not self.cycle.response_complete:
            self._close()
            return
        body = ApiError(status, message, code=code).encoded()
        self.transport.write(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body,
        ]))
        self._linger()

    def _linger(self) -> None:
        """Read nothing more from this connection: shut its write side once the answer is out, drop what still
        arrives, and close it after :data:`LINGER_S` (at once if the client closes first)."""
        self._lingering = True
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_S, self._close)

    def _close(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_timed_out(self) -> None:
        log.debug("closing a connection whose request headers did not arrive within %.1f s", self.header_timeout_s)
        self._close()

    def _body_timed_out(self) -> None:
        log.debug("closing a connection whose request body did not arrive within %.1f s", self.body_timeout_s)
        self._close()


class HeadWithBody:
    """The transport a request cycle writes its answer to: what uvicorn writes while ``holding`` (the status line and
    headers) waits, and goes out with the next write (the first body bytes) as one ``writelines``, which the loop
    sends in one syscall. ``close`` sends what is held first. uvicorn's cycle uses only ``write``, ``close`` and
    ``is_closing`` of its transport."""

    __slots__ = ("transport", "holding", "_held")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.holding = False
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self.holding:
            self._held.append(data)
        elif self._held:
            self._held.append(data)
            self.transport.writelines(self._held)
            self._held = []
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self._held:
            self.transport.writelines(self._held)
            self._held = []

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()
