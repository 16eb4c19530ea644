"""kvgate's HTTP/1.1 server protocol (:class:`~kvgate.router.app.protocol.HttpProtocol`) on real loopback sockets:
HEAD answered without a body, ``100 Continue`` said only when the endpoint reads, streamed answers framed in chunks
(or raw to an HTTP/1.0 client) and their iterator closed however they end, an early answer closing the connection,
the idle keep-alive timer, a client leaving while its endpoint waits, and the 404 and 405 error shapes. What arrives
malformed, too large or pipelined is fuzzed in tests/abuse/test_fuzz_connections.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.responses import Response
from uvicorn.server import ServerState

from kvgate.router.app.protocol import CONTINUE, HttpProtocol
from kvgate.router.app.routes import Routes
from kvgate.router.core.http import BodyWriter, HttpRequest, StreamedAnswer
from kvgate.router.pipeline.disconnect import while_connected
from tests.served import served
from tests.support import wait_until_async

DEADLINE_S = 5.0
"""The most any wait of these tests lasts: far beyond what loopback needs, short enough to fail quickly."""
QUIET_S = 0.2
"""How long the wire is watched to show that nothing is sent (yet)."""
PAGE = b"hello world"


@contextlib.asynccontextmanager
async def serving(routes: Routes, keep_alive_s: float = 5.0) -> AsyncIterator[tuple[str, ServerState]]:
    """Like :func:`tests.served.served`, with its own keep-alive and the server's state (its open connections)."""
    loop = asyncio.get_running_loop()
    state = ServerState()
    server = await loop.create_server(
        lambda: HttpProtocol(None, state, {}, loop, routes=routes, header_timeout_s=10.0, body_timeout_s=10.0,
                             max_header_bytes=65536, max_headers=100, keep_alive_s=keep_alive_s),
        "127.0.0.1", 0,
    )
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", state
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def raw(base_url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to the server, closed when the block ends."""
    address = urlsplit(base_url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(address.hostname, address.port), DEADLINE_S)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), DEADLINE_S)


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The head and the Content-Length body of the next answer."""
    head = await read_head(reader)
    return head, await asyncio.wait_for(reader.readexactly(content_length(head)), DEADLINE_S)


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes the connection."""
    return await asyncio.wait_for(reader.read(), DEADLINE_S)


async def nothing_arrives(reader: asyncio.StreamReader) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), QUIET_S)


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no content-length in {head!r}")


def header_lines(head: bytes) -> list[bytes]:
    return [line.lower() for line in head.split(b"\r\n")[1:] if line]


async def page(request: HttpRequest) -> Response:
    return Response(PAGE, media_type="text/plain")


class RecordedBody:
    """A streamed answer's body that records how it was written and closed. It writes nothing until ``first`` is
    set; with ``then_hang``, after its parts it waits forever (until cancelled)."""

    def __init__(self, parts: list[bytes], then_hang: bool = False) -> None:
        self.parts = list(parts)
        self.then_hang = then_hang
        self.first = asyncio.Event()
        self.asked = asyncio.Event()
        """Set once the server asked for the body."""
        self.hanging = asyncio.Event()
        """Set once every part is written and the body waits (``then_hang``)."""
        self.cancelled = False
        self.closes = 0
        self.closed = asyncio.Event()

    async def write_to(self, out: BodyWriter) -> None:
        self.asked.set()
        await self.first.wait()
        for part in self.parts:
            out.write(part)
        if self.then_hang:
            self.hanging.set()
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.cancelled = True
                raise

    async def aclose(self) -> None:
        self.closes += 1
        self.closed.set()


def streaming(chunks: RecordedBody) -> Routes:
    async def stream(request: HttpRequest) -> StreamedAnswer:
        return StreamedAnswer(200, {"content-type": "text/plain"}, chunks)

    routes = Routes()
    routes.add("GET", "/stream", stream)
    routes.add("GET", "/page", page)
    return routes


# HEAD


async def test_a_head_request_gets_the_get_answers_head_and_no_body() -> None:
    routes = Routes()
    routes.add("GET", "/page", page)
    async with served(routes) as base_url, raw(base_url) as (reader, writer):
        writer.write(b"HEAD /page HTTP/1.1\r\nhost: t\r\n\r\n")
        head = await read_head(reader)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"content-length: %d" % len(PAGE) in header_lines(head)
        # the next bytes on the connection are the next answer's: no body followed the HEAD's head
        writer.write(b"GET /page HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        rest = await read_to_eof(reader)
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n")
    assert rest.endswith(b"\r\n\r\n" + PAGE)


# Expect: 100-continue


async def test_100_continue_is_sent_only_once_the_endpoint_reads_the_body() -> None:
    entered = asyncio.Event()
    reading = asyncio.Event()

    async def upload(request: HttpRequest) -> Response:
        entered.set()
        await reading.wait()
        return Response(b"".join([chunk async for chunk in request.chunks()]), media_type="text/plain")

    routes = Routes()
    routes.add("POST", "/upload", upload)
    async with served(routes) as base_url, raw(base_url) as (reader, writer):
        writer.write(b"POST /upload HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
        await asyncio.wait_for(entered.wait(), DEADLINE_S)
        await nothing_arrives(reader)  # the endpoint has not asked for the body yet
        reading.set()
        assert await read_head(reader) == CONTINUE
        writer.write(b"hello")
        head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == b"hello"


# streamed answers


async def test_a_streamed_answer_is_chunked_with_its_head_sent_with_the_first_chunk() -> None:
    chunks = RecordedBody([b"hello", b"x" * 300, b"", b"end"])
    async with served(streaming(chunks)) as base_url, raw(base_url) as (reader, writer):
        writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.wait_for(chunks.asked.wait(), DEADLINE_S)
        await nothing_arrives(reader)  # no head before the first chunk
        chunks.first.set()
        head = await read_head(reader)
        expected = b"5\r\nhello\r\n12c\r\n" + b"x" * 300 + b"\r\n3\r\nend\r\n0\r\n\r\n"  # the empty chunk is skipped
        body = await asyncio.wait_for(reader.readexactly(len(expected)), DEADLINE_S)
        # the connection is kept alive, and nothing else followed the terminator
        writer.write(b"GET /page HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        rest = await read_to_eof(reader)
        await asyncio.wait_for(chunks.closed.wait(), DEADLINE_S)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in header_lines(head)
    assert not any(line.startswith(b"content-length") or line.startswith(b"connection") for line in header_lines(head))
    assert body == expected
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.endswith(PAGE)
    assert chunks.closes == 1


async def test_a_client_leaving_mid_stream_cancels_the_writing_and_closes_the_body() -> None:
    chunks = RecordedBody([b"first"], then_hang=True)
    chunks.first.set()
    async with served(streaming(chunks)) as base_url:
        async with raw(base_url) as (reader, writer):
            writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n5\r\nfirst\r\n"), DEADLINE_S)
            await asyncio.wait_for(chunks.hanging.wait(), DEADLINE_S)
        await asyncio.wait_for(chunks.closed.wait(), DEADLINE_S)  # the client has gone
    assert chunks.cancelled
    assert chunks.closes == 1


async def test_an_http_1_0_client_gets_the_raw_stream_and_then_the_close() -> None:
    chunks = RecordedBody([b"hello", b"x" * 300, b"end"])
    chunks.first.set()
    async with served(streaming(chunks)) as base_url, raw(base_url) as (reader, writer):
        writer.write(b"GET /stream HTTP/1.0\r\nhost: t\r\nconnection: keep-alive\r\n\r\n")
        answer = await read_to_eof(reader)  # the close ends it
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"connection: close" in header_lines(head)
    assert not any(line.startswith(b"transfer-encoding") for line in header_lines(head))
    assert body == b"hello" + b"x" * 300 + b"end"
    assert chunks.closes == 1


class FloodBody:
    """Writes ``total`` bytes at once, in 64 KiB chunks, and records when the server asks it to pause and resume."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.paused = asyncio.Event()
        self.resumed = asyncio.Event()
        self.done = asyncio.Event()

    async def write_to(self, out: BodyWriter) -> None:
        out.hold_source(self.paused.set, self.resumed.set)
        for _ in range(self.total // 65536):
            out.write(b"z" * 65536)
        await self.done.wait()  # a source that stays open until the test has seen the flow

    async def aclose(self) -> None:
        pass


async def test_a_client_that_does_not_read_pauses_the_streamed_answers_source_until_it_reads() -> None:
    body = FloodBody(8 * 1024 * 1024)

    async def stream(request: HttpRequest) -> StreamedAnswer:
        return StreamedAnswer(200, {"content-type": "text/plain"}, body)

    routes = Routes()
    routes.add("GET", "/flood", stream)
    async with served(routes) as base_url, raw(base_url) as (reader, writer):
        writer.write(b"GET /flood HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.wait_for(body.paused.wait(), DEADLINE_S)  # nothing read: the socket fills
        assert not body.resumed.is_set()
        received = 0
        while not body.resumed.is_set():
            received += len(await asyncio.wait_for(reader.read(1 << 20), DEADLINE_S))
        body.done.set()
    assert received > 0


# closing connections


async def test_an_answer_before_the_whole_body_says_close_and_the_connection_closes() -> None:
    async def refuse(request: HttpRequest) -> Response:
        return Response(b"no", status_code=413, media_type="text/plain")  # without reading the body

    routes = Routes()
    routes.add("POST", "/refuse", refuse)
    async with serving(routes) as (base_url, state), raw(base_url) as (reader, writer):
        writer.write(b"POST /refuse HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\n" + b"a" * 1000)
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 413 ")
        assert b"connection: close" in header_lines(head)
        assert body == b"no"
        assert await read_to_eof(reader) == b""  # nothing more is sent
        # the client keeps its socket open (and still sends): the server closes its end within the linger
        writer.write(b"a" * 1000)
        await wait_until_async(lambda: not state.connections, "the server to close the connection",
                               timeout=DEADLINE_S)


async def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_s() -> None:
    routes = Routes()
    routes.add("GET", "/page", page)
    keep_alive_s = 0.3
    async with serving(routes, keep_alive_s=keep_alive_s) as (base_url, state), raw(base_url) as (reader, writer):
        writer.write(b"GET /page HTTP/1.1\r\nhost: t\r\n\r\n")
        head, body = await read_answer(reader)
        idle_since = time.monotonic()
        assert not any(line.startswith(b"connection") for line in header_lines(head))  # kept alive
        assert body == PAGE
        assert await read_to_eof(reader) == b""
        idle_s = time.monotonic() - idle_since
        await wait_until_async(lambda: not state.connections, "the server to forget the connection",
                               timeout=DEADLINE_S)
    assert keep_alive_s * 0.8 <= idle_s < keep_alive_s + 2.0


# a client that leaves


async def test_while_connected_returns_none_when_the_client_leaves_and_the_task_goes_on() -> None:
    guarded = asyncio.Event()
    finished = asyncio.Event()
    seen: dict[str, Any] = {}
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def work() -> str:
        guarded.set()
        return await never

    async def waiting(request: HttpRequest) -> Response:
        seen["result"] = await while_connected(request, work())
        task = asyncio.current_task()
        assert task is not None
        seen["cancelling"] = task.cancelling()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.sleep(0.01)  # the task is not cancelled again at its next await
        seen["awaited_after"] = True
        finished.set()
        return Response(b"unsent", media_type="text/plain")

    routes = Routes()
    routes.add("GET", "/wait", waiting)
    async with served(routes) as base_url:
        async with raw(base_url) as (reader, writer):
            writer.write(b"GET /wait HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.wait_for(guarded.wait(), DEADLINE_S)
        await asyncio.wait_for(finished.wait(), DEADLINE_S)
    assert seen == {"result": None, "cancelling": 0, "awaited_after": True}
    assert never.cancelled()


# errors


async def test_an_unknown_path_is_404_and_a_wrong_method_405_with_allow_both_in_openais_shape() -> None:
    routes = Routes()
    routes.add("GET", "/page", page)
    async with served(routes) as base_url, httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S,
                                                             trust_env=False) as client:
        missing = await client.get("/nowhere")
        wrong = await client.post("/page", content=b"{}")
    assert missing.status_code == 404
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "GET, HEAD"
    assert "allow" not in missing.headers
    for answer in (missing, wrong):
        assert answer.headers["content-type"] == "application/json"
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    assert missing.json()["error"] == {"message": "Not Found", "type": "not_found_error", "param": None, "code": "404"}
    assert wrong.json()["error"]["code"] == "405"
    assert wrong.json()["error"]["type"] == "invalid_request_error"
