"""uvicorn's httptools protocol with a deadline on each request's line and headers (slowloris).

uvicorn bounds an idle connection between requests (``timeout_keep_alive``) and nothing else: the first byte of a
request cancels the keep-alive timer, and a fresh connection has none. A client that sends its request line and
headers a byte at a time, or nothing at all, holds a connection, a file descriptor and a parser for as long as it
likes; a few hundred of them are the slowloris attack. ASGI middleware cannot help, because the app sees a request
only once its headers are complete. So the protocol itself closes a connection whose request headers have not
arrived within ``header_timeout_s`` of the connection opening, or of the next request's first byte on a kept-alive
connection, as Go's ``ReadHeaderTimeout`` and nginx's ``client_header_timeout`` do. The body has its own deadline in
the app (``server.body_timeout_s``, a 408), and a response, however long it streams, is never cut by this one.

A subclass of uvicorn's ``HttpToolsProtocol`` that overrides only its public callbacks (the asyncio protocol's
``connection_made`` / ``connection_lost`` and the httptools parser's ``on_message_begin`` / ``on_headers_complete``),
passed to ``uvicorn.Config(http=...)``, which accepts a protocol class in place of a name.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvgate.server")


class HeaderDeadlineProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()  # the next request on a kept-alive connection (a fresh one's is already armed)

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            log.debug("closing a connection whose request headers did not arrive within %.1f s", self.header_timeout_s)
            self.transport.close()
