"""The engines' HTTP/1.1 client (:class:`~kvgate.router.upstream.client.EngineClient`) against real loopback servers
that write exact bytes: keep-alive reuse and the per-origin pool limit, every body framing and skipped 1xx answers,
header injection refused before anything is sent, abandoned and released answers, backpressure on an unread
answer, the one resend of a request a kept-alive connection dropped, the total deadline, malformed answers and
refused connections, ``fetch`` and its size limit, and the URL and request-head helpers."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from kvgate.router.upstream.client import (
    ANSWER_HEAD_MAX_BYTES,
    HIGH_WATER_BYTES,
    EngineClient,
    EngineResponse,
    UpstreamBodyTooLarge,
    UpstreamConnectError,
    UpstreamDisconnected,
    request_head,
    split_hostport,
    split_url,
)
from tests.support import wait_until_async

DEADLINE_S = 5.0
"""The most any wait of these tests lasts: far beyond what loopback needs, short enough to fail quickly."""
CONNECT_S = 2.0


@dataclass
class Conn:
    """One connection the server accepted."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int
    """1 for the first connection accepted, 2 for the next..."""
    wire: Wire
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once :meth:`until_end` saw the client close (EOF or reset)."""

    async def next_request(self) -> bytes | None:
        """The next request's head and body (recorded in ``wire.requests``), None when the client closed first."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        request = head + await self.reader.readexactly(length)
        self.wire.requests.append((self.index, request))
        return request

    async def answer(self, *parts: bytes) -> None:
        """Write ``parts`` one write (and drain) each."""
        for part in parts:
            self.writer.write(part)
            await self.writer.drain()

    async def until_end(self) -> None:
        """Read (and drop) until the client closes the connection."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.ended.set()


@dataclass
class Wire:
    """A raw loopback server, and what it saw."""

    url: str = ""
    accepted: int = 0
    open: int = 0
    most_open: int = 0
    """The most connections open at once."""
    conns: list[Conn] = field(default_factory=list)
    requests: list[tuple[int, bytes]] = field(default_factory=list)
    """Every request received: (connection index, head and body)."""


Handler = Callable[[Conn], Awaitable[None]]


@contextlib.asynccontextmanager
async def wire_server(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[Wire]:
    """``handler`` run on each connection a loopback server accepts; every connection closed when the block ends."""
    wire = Wire()
    tasks: set[asyncio.Task[None]] = set()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        wire.accepted += 1
        wire.open += 1
        wire.most_open = max(wire.most_open, wire.open)
        conn = Conn(reader, writer, wire.accepted, wire)
        wire.conns.append(conn)
        try:
            await handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            wire.open -= 1
            writer.close()

    server = await asyncio.start_server(on_connection, host, 0)
    port = server.sockets[0].getsockname()[1]
    wire.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    try:
        yield wire
    finally:
        server.close()
        for conn in wire.conns:
            conn.writer.transport.abort()  # its handler's reads end
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE_S)
        await asyncio.wait_for(server.wait_closed(), DEADLINE_S)


def answering(answer: bytes) -> Handler:
    """A handler answering every request of a connection with ``answer``, until the client closes."""

    async def handler(conn: Conn) -> None:
        while await conn.next_request() is not None:
            await conn.answer(answer)

    return handler


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


async def get(client: EngineClient, url: str, timeout_s: float | None = DEADLINE_S) -> tuple[int, bytes]:
    """Status and body of a GET, read whole within the test's deadline."""
    async with asyncio.timeout(DEADLINE_S):
        response = await client.request("GET", url, connect_timeout_s=CONNECT_S, timeout_s=timeout_s)
        return response.status, await response.read()


async def piped(
    client: EngineClient, url: str,
) -> tuple[EngineResponse, list[bytes], asyncio.Future[BaseException | None]]:
    """A GET's answer piped into a list as it arrives, and the future its end is told to."""
    response = await asyncio.wait_for(client.request("GET", url, connect_timeout_s=CONNECT_S), DEADLINE_S)
    got: list[bytes] = []
    ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    response.pipe(got.append, ended.set_result)
    return response, got, ended


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the pool


async def test_sequential_requests_to_one_origin_share_one_connection() -> None:
    async with wire_server(answering(ok(b"hello"))) as wire, EngineClient(max_per_origin=4) as client:
        assert await get(client, wire.url + "/a") == (200, b"hello")
        assert await get(client, wire.url + "/b") == (200, b"hello")
    assert wire.accepted == 1
    assert [(index, request.split(b" ")[1]) for index, request in wire.requests] == [(1, b"/a"), (1, b"/b")]


async def test_requests_beyond_the_pool_limit_wait_for_a_connection() -> None:
    release = asyncio.Event()
    held = 0

    async def holding(conn: Conn) -> None:
        nonlocal held
        while await conn.next_request() is not None:
            held += 1
            await release.wait()
            await conn.answer(ok(b"done"))

    async with wire_server(holding) as wire, EngineClient(max_per_origin=2) as client:
        requests = [asyncio.create_task(get(client, f"{wire.url}/{i}")) for i in range(5)]
        try:
            waiting = lambda: sum(len(pool.waiters) for pool in client._pools.values())  # noqa: E731
            await wait_until_async(lambda: held >= 2 and held + waiting() == 5,
                                   "every request held by the server or waiting in the pool", timeout=DEADLINE_S)
            assert (held, waiting(), wire.most_open) == (2, 3, 2)
            release.set()
            answers = await asyncio.wait_for(asyncio.gather(*requests), DEADLINE_S)
        finally:
            for request in requests:
                request.cancel()
    assert answers == [(200, b"done")] * 5
    assert wire.most_open == 2
    assert sorted(request.split(b" ")[1] for _, request in wire.requests) == [b"/%d" % i for i in range(5)]


# framing


@pytest.mark.parametrize(("parts", "status", "body"), [
    pytest.param([b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"], 200, b"hello world",
                 id="content-length"),
    pytest.param([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", b"6\r\n world\r\n",
                  b"0\r\n\r\n"], 200, b"hello world", id="chunked"),
    pytest.param([b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello", b" world"], 200, b"hello world",
                  id="until-close"),
    pytest.param([b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"], 201,
                 b"ok", id="100-continue-skipped"),
])
async def test_a_body_is_read_exactly_however_it_is_framed(parts: list[bytes], status: int, body: bytes) -> None:
    async def handler(conn: Conn) -> None:
        if await conn.next_request() is not None:
            await conn.answer(*parts)
            if b"connection: close" in parts[0]:
                return  # the close ends the body
            await conn.until_end()

    async with wire_server(handler) as wire, EngineClient(max_per_origin=4) as client:
        async with asyncio.timeout(DEADLINE_S):
            response = await client.request("POST", wire.url + "/x", body=b"{}", connect_timeout_s=CONNECT_S)
            assert response.status == status
            assert await response.read() == body
            assert response.complete


# header injection


@pytest.mark.parametrize("headers", [
    {"x-a": "b\r\nx-injected: 1"},
    {"x-a": "b\nx-injected: 1"},
    {"x-a": "b\0"},
    {"x-a\r\nx-injected": "1"},
], ids=["crlf-in-value", "lf-in-value", "nul-in-value", "crlf-in-name"])
async def test_a_header_holding_a_line_break_is_refused_before_anything_is_sent(headers: dict[str, str]) -> None:
    async with wire_server(answering(ok(b"fine"))) as wire, EngineClient(max_per_origin=4) as client:
        with pytest.raises(ValueError):
            await asyncio.wait_for(
                client.request("GET", wire.url + "/x", headers, connect_timeout_s=CONNECT_S), DEADLINE_S)
        assert wire.accepted == 0
        assert await get(client, wire.url + "/next") == (200, b"fine")
    assert len(wire.requests) == 1  # only the next request was written
    assert b"x-injected" not in wire.requests[0][1]
    assert wire.requests[0][1].startswith(b"GET /next ")


# abandoning and releasing


async def test_closing_a_streamed_answer_closes_its_connection_and_the_client_goes_on() -> None:
    async def handler(conn: Conn) -> None:
        if conn.index == 1:  # a stream that never ends on its own
            await conn.next_request()
            await conn.answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await conn.until_end()
        else:
            await answering(ok(b"after"))(conn)

    async with wire_server(handler) as wire, EngineClient(max_per_origin=4) as client:
        async with asyncio.timeout(DEADLINE_S):
            response = await client.request("GET", wire.url + "/stream", connect_timeout_s=CONNECT_S)
            received = b""
            while len(received) < 5:
                received += await response.readany()
            assert received == b"first"
            response.close()
            await wire.conns[0].ended.wait()  # the engine saw the close
        with pytest.raises(UpstreamDisconnected):
            await response.readany()
        assert await get(client, wire.url + "/next") == (200, b"after")
    assert wire.accepted == 2


async def test_releasing_a_complete_answer_gives_its_connection_back() -> None:
    async with wire_server(answering(ok(b"whole"))) as wire, EngineClient(max_per_origin=4) as client:
        response = await asyncio.wait_for(client.request("GET", wire.url + "/a", connect_timeout_s=CONNECT_S),
                                          DEADLINE_S)
        await wait_until_async(lambda: response.complete, "the answer to arrive whole", timeout=DEADLINE_S)
        response.release()  # complete though unread: the connection is not closed
        assert await get(client, wire.url + "/b") == (200, b"whole")
        assert await response.read() == b"whole"  # what had arrived is still there
    assert wire.accepted == 1
    assert [index for index, _ in wire.requests] == [1, 1]


# backpressure


async def test_an_unread_answer_stops_being_read_at_the_high_water_mark() -> None:
    payload = random.Random(0).randbytes(20 * 1024 * 1024)

    async def flooding(conn: Conn) -> None:
        await conn.next_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        conn.writer.write(payload)  # as fast as the socket takes it
        await conn.writer.drain()
        await conn.until_end()

    async with wire_server(flooding) as wire, EngineClient(max_per_origin=4) as client:
        response = await asyncio.wait_for(client.request("GET", wire.url + "/big", connect_timeout_s=CONNECT_S),
                                          DEADLINE_S)
        await wait_until_async(lambda: response._buffered > HIGH_WATER_BYTES, "the high water mark",
                               timeout=DEADLINE_S)
        await asyncio.sleep(0.3)  # time for more to arrive, were the connection still reading
        assert response._buffered <= HIGH_WATER_BYTES + 1024 * 1024
        assert wire.conns[0].writer.transport.get_write_buffer_size() > 0  # the engine is held back, not drained
        body = await asyncio.wait_for(response.read(), DEADLINE_S)
    assert len(body) == len(payload)
    assert body == payload


async def test_a_piped_answer_hands_over_every_chunk_and_stops_while_its_sink_is_held() -> None:
    payload = random.Random(1).randbytes(8 * 1024 * 1024)

    async def flooding(conn: Conn) -> None:
        await conn.next_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        conn.writer.write(payload)
        await conn.writer.drain()
        await conn.until_end()

    async with wire_server(flooding) as wire, EngineClient(max_per_origin=4) as client:
        response, got, ended = await piped(client, wire.url + "/big")
        await wait_until_async(lambda: got, "the first chunks", timeout=DEADLINE_S)
        response.pause_reading()
        held = sum(map(len, got))
        await asyncio.sleep(0.3)  # time for more to arrive, were the connection still reading
        assert sum(map(len, got)) <= held + 1024 * 1024  # at most what was already read off the socket
        assert wire.conns[0].writer.transport.get_write_buffer_size() > 0  # the engine is held back
        response.resume_reading()
        assert await asyncio.wait_for(ended, DEADLINE_S) is None
    assert b"".join(got) == payload and response.complete


async def test_a_piped_answer_hands_over_what_each_read_brings_as_one_chunk() -> None:
    piping, first_seen = asyncio.Event(), asyncio.Event()
    events = [b"data: %d\n\n" % i for i in range(4)]

    def framed(event: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(event), event)

    async def streaming(conn: Conn) -> None:
        await conn.next_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await conn.writer.drain()
        await piping.wait()
        conn.writer.write(b"".join(framed(event) for event in events[:3]))  # three events in one segment
        await conn.writer.drain()
        await first_seen.wait()
        await conn.answer(framed(events[3]) + b"0\r\n\r\n")
        await conn.until_end()

    async with wire_server(streaming) as wire, EngineClient(max_per_origin=4) as client:
        _, got, ended = await piped(client, wire.url + "/sse")
        piping.set()
        await wait_until_async(lambda: got, "the first events", timeout=DEADLINE_S)
        assert got == [b"".join(events[:3])]  # one write for the client, not three
        first_seen.set()
        assert await asyncio.wait_for(ended, DEADLINE_S) is None
    assert got == [b"".join(events[:3]), events[3]]


# a connection closing under a request


async def test_a_request_on_a_kept_alive_connection_closing_under_it_is_sent_again() -> None:
    async def handler(conn: Conn) -> None:
        if conn.index == 1:
            await conn.next_request()
            await conn.answer(ok(b"first"))
            await conn.reader.read(1)  # the next request arrives: close without reading or answering it
            conn.writer.close()
        else:
            await answering(ok(b"second"))(conn)

    async with wire_server(handler) as wire, EngineClient(max_per_origin=4) as client:
        assert await get(client, wire.url + "/a") == (200, b"first")
        assert await get(client, wire.url + "/b") == (200, b"second")
    assert wire.accepted == 2
    assert [(index, request.split(b" ")[1]) for index, request in wire.requests] == [(1, b"/a"), (2, b"/b")]


async def test_a_fresh_connection_closed_before_any_answer_is_not_retried() -> None:
    async def closing(conn: Conn) -> None:
        await conn.next_request()
        conn.writer.close()

    async with wire_server(closing) as wire, EngineClient(max_per_origin=4) as client:
        with pytest.raises(UpstreamDisconnected):
            await get(client, wire.url + "/x")
    assert wire.accepted == 1
    assert len(wire.requests) == 1


# the deadline


async def test_a_stalled_body_times_out_and_closes_the_connection() -> None:
    async def stalling(conn: Conn) -> None:
        await conn.next_request()
        await conn.answer(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
        await conn.until_end()

    timeout_s = 0.5
    async with wire_server(stalling) as wire, EngineClient(max_per_origin=4) as client:
        started = time.monotonic()
        response = await asyncio.wait_for(
            client.request("GET", wire.url + "/x", connect_timeout_s=CONNECT_S, timeout_s=timeout_s), DEADLINE_S)
        assert response.status == 200
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.read(), DEADLINE_S)
        elapsed = time.monotonic() - started
        assert timeout_s * 0.9 <= elapsed < timeout_s + 1.0  # the client's deadline, not the test's
        await asyncio.wait_for(wire.conns[0].ended.wait(), DEADLINE_S)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nabc",
], ids=["content-length", "read-until-close"])
async def test_a_deadline_passed_while_nobody_reads_is_still_a_timeout_when_read(answer: bytes) -> None:
    """The close that follows a deadline must not turn the answer into another failure, nor a body cut short by it
    into a complete one."""
    async def stalling(conn: Conn) -> None:
        await conn.next_request()
        await conn.answer(answer)
        await conn.until_end()

    async with wire_server(stalling) as wire, EngineClient(max_per_origin=4) as client:
        response = await asyncio.wait_for(
            client.request("GET", wire.url + "/x", connect_timeout_s=CONNECT_S, timeout_s=0.3), DEADLINE_S)
        pool = next(iter(client._pools.values()))
        await wait_until_async(lambda: pool.open == 0, timeout=DEADLINE_S, what="the client's side of the close")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.read(), DEADLINE_S)
        assert not response.complete


# malformed answers and refused connections


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 abc\r\n\r\n",
    b"\x00\x01\x02 not http at all\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
], ids=["bad-status", "garbage", "bad-chunk-size"])
async def test_a_malformed_answer_is_an_upstream_disconnect(answer: bytes) -> None:
    async def handler(conn: Conn) -> None:
        await conn.next_request()
        await conn.answer(answer)
        await conn.until_end()

    async with wire_server(handler) as wire, EngineClient(max_per_origin=4) as client:
        with pytest.raises(UpstreamDisconnected):
            await get(client, wire.url + "/x")
        await asyncio.wait_for(wire.conns[0].ended.wait(), DEADLINE_S)  # and its connection is closed


@pytest.mark.parametrize("shape", ["many headers", "one endless header"])
async def test_an_answer_head_beyond_its_bound_is_an_upstream_disconnect(shape: str) -> None:
    """Whatever answers at an engine's URL cannot grow the gateway's memory with a head that never ends."""
    head = (b"".join(b"x-%d: %s\r\n" % (i, b"a" * 100) for i in range(ANSWER_HEAD_MAX_BYTES // 100))
            if shape == "many headers" else b"x-big: " + b"a" * (2 * ANSWER_HEAD_MAX_BYTES))

    async def handler(conn: Conn) -> None:
        await conn.next_request()
        await conn.answer(b"HTTP/1.1 200 OK\r\n" + head)  # never ends its head
        await conn.until_end()

    async with wire_server(handler) as wire, EngineClient(max_per_origin=4) as client:
        with pytest.raises(UpstreamDisconnected, match="head exceeds"):
            await get(client, wire.url + "/x")
        await asyncio.wait_for(wire.conns[0].ended.wait(), DEADLINE_S)  # and its connection is closed


async def test_a_head_within_its_bound_arriving_with_a_large_body_is_read_whole() -> None:
    head_fill = b"x-fill: " + b"a" * (ANSWER_HEAD_MAX_BYTES - 200) + b"\r\n"
    body = b"y" * (4 * ANSWER_HEAD_MAX_BYTES)
    answer = b"HTTP/1.1 200 OK\r\n" + head_fill + b"content-length: %d\r\n\r\n" % len(body) + body
    async with wire_server(answering(answer)) as wire, EngineClient(max_per_origin=4) as client:
        for _ in range(2):  # the bound starts again with each answer on the kept-alive connection
            assert await get(client, wire.url + "/x") == (200, body)


async def test_a_refused_connection_is_an_upstream_connect_error() -> None:
    async with EngineClient(max_per_origin=4) as client:
        with pytest.raises(UpstreamConnectError):
            await get(client, f"http://127.0.0.1:{unused_port()}/x")


# fetch


async def test_fetch_refuses_an_answer_larger_than_max_bytes() -> None:
    async with wire_server(answering(ok(b"x" * 10_000))) as wire, EngineClient(max_per_origin=4) as client:
        with pytest.raises(UpstreamBodyTooLarge):
            await client.fetch("GET", wire.url + "/metrics", timeout_s=DEADLINE_S, max_bytes=1000)
        fetched = await client.fetch("GET", wire.url + "/metrics", timeout_s=DEADLINE_S, max_bytes=10_000)
    assert fetched.body == b"x" * 10_000  # exactly max_bytes is allowed


async def test_fetch_returns_the_status_headers_and_body() -> None:
    answer = b"HTTP/1.1 201 Created\r\nX-Custom-Header: Some Value\r\nContent-Length: 4\r\n\r\nbody"
    async with wire_server(answering(answer)) as wire, EngineClient(max_per_origin=4) as client:
        fetched = await client.fetch("POST", wire.url + "/v1/x?y=1", {"x-asked": "1"}, b"{}", timeout_s=DEADLINE_S)
    assert fetched.status == 201
    assert fetched.headers == [("x-custom-header", "Some Value"), ("content-length", "4")]
    assert fetched.header("x-custom-header") == "Some Value"
    assert fetched.body == b"body"
    request = wire.requests[0][1]
    assert request.startswith(b"POST /v1/x?y=1 HTTP/1.1\r\n")
    assert b"\r\nx-asked: 1\r\n" in request and request.endswith(b"\r\n\r\n{}")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_request_to_an_ipv6_origin_names_it_in_brackets() -> None:
    async with wire_server(answering(ok(b"six")), host="::1") as wire, EngineClient(max_per_origin=4) as client:
        assert await get(client, wire.url + "/x") == (200, b"six")
    port = wire.url.rsplit(":", 1)[1]
    assert wire.requests[0][1].startswith(b"GET /x HTTP/1.1\r\nhost: [::1]:%b\r\n" % port.encode())


# pure helpers


@pytest.mark.parametrize(("url", "origin", "target"), [
    ("http://[::1]:8000/v1/chat/completions", "http://[::1]:8000", "/v1/chat/completions"),
    ("http://engine:8000/v1/x?a=1&b=%20", "http://engine:8000", "/v1/x?a=1&b=%20"),
    ("https://engine", "https://engine", "/"),
    ("http://engine:8000?name=1", "http://engine:8000", "/?name=1"),
])
def test_split_url_separates_the_origin_from_the_request_target(url: str, origin: str, target: str) -> None:
    assert split_url(url) == (origin, target)


@pytest.mark.parametrize("url", ["engine:8000/x", "/v1/x", "://engine/x"])
def test_split_url_refuses_a_url_that_is_not_absolute(url: str) -> None:
    with pytest.raises(ValueError):
        split_url(url)


@pytest.mark.parametrize(("hostport", "default", "expected"), [
    ("[::1]:8000", 80, ("::1", 8000)),
    ("[::1]", 443, ("::1", 443)),
    ("[fe80::1%25eth0]:9", 80, ("fe80::1%25eth0", 9)),
    ("engine", 80, ("engine", 80)),
    ("engine:8080", 80, ("engine", 8080)),
    ("10.0.0.1:1", 80, ("10.0.0.1", 1)),
])
def test_split_hostport_reads_the_host_and_the_port_or_the_default(hostport: str, default: int,
                                                                   expected: tuple[str, int]) -> None:
    assert split_hostport(hostport, default) == expected


def test_request_head_writes_the_request_line_host_headers_and_length() -> None:
    assert request_head("POST", "/v1/x?a=1", "[::1]:8000", {"x-a": "b"}, b"{}") == (
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: [::1]:8000\r\nx-a: b\r\ncontent-length: 2\r\n\r\n")
    assert request_head("GET", "/metrics", "engine:80", None, b"") == (
        b"GET /metrics HTTP/1.1\r\nhost: engine:80\r\n\r\n")  # no body, no length
    assert request_head("POST", "/", "h:1", {}, b"").endswith(b"\r\ncontent-length: 0\r\n\r\n")  # a POST says 0


@pytest.mark.parametrize(("method", "target", "headers"), [
    ("GET", "/a b", None),
    ("GET", "/a\r\nx: 1", None),
    ("GET\r\n", "/", None),
    ("GET", "/", {"x": "a\r\n"}),
])
def test_request_head_refuses_what_http_does_not_allow(method: str, target: str,
                                                       headers: dict[str, str] | None) -> None:
    with pytest.raises(ValueError):
        request_head(method, target, "h:1", headers, b"")
