"""Property-based fuzzing (Hypothesis) of what arrives on a connection: kvgate's HTTP protocol
(:class:`~kvgate.router.app.protocol.HttpProtocol`) fed request heads of every size and count, pipelined
requests, garbage, and all of it cut at random points (a trickle is the extreme: a byte at a time). Whatever
arrives, the protocol never raises, never hands the parser more of a request's head than ``max_header_bytes``,
answers what is too large with a JSON 431 and what is malformed with a JSON 400, and answers every well-formed
request of a pipeline in order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.responses import Response
from uvicorn.server import ServerState

from kvgate.router.app.protocol import HttpProtocol
from kvgate.router.app.routes import Routes
from kvgate.router.core.http import HttpRequest
from kvgate.router.pipeline.bodies import read_body

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_HEADER_BYTES = 2048
MAX_HEADERS = 16


class Transport(asyncio.Transport):
    """Records what the protocol writes and whether it closed or half-closed the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False
        self.eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def echo(request: HttpRequest) -> Response:
    """Answers with the request's header count, after reading its body as the gateway's endpoints do."""
    await read_body(request, 1 << 20, 60.0, None)
    body = json.dumps({"path": request.path, "headers": len(request.headers)}).encode()
    return Response(body, media_type="application/json")


ROUTES = Routes()
ROUTES.add("POST", "/v1/x", echo)


def run(chunks: list[bytes]) -> Transport:
    """Feed ``chunks`` to a fresh protocol on its own loop and let its requests be answered."""
    loop = asyncio.new_event_loop()
    try:
        protocol = HttpProtocol(config=None, server_state=ServerState(), app_state={}, _loop=loop, routes=ROUTES,
                                header_timeout_s=60, body_timeout_s=60, max_header_bytes=MAX_HEADER_BYTES,
                                max_headers=MAX_HEADERS, keep_alive_s=60)
        transport = Transport()
        protocol.connection_made(transport)
        fed = 0
        for chunk in chunks:
            if transport.is_closing():
                break
            protocol.data_received(chunk)
            fed += 1
            loop.run_until_complete(asyncio.sleep(0))  # let the app answer what is complete
        for _ in range(20):
            loop.run_until_complete(asyncio.sleep(0))
        protocol.connection_lost(None)
        loop.run_until_complete(asyncio.sleep(0))
        return transport
    finally:
        loop.close()


def cut(data: bytes, points: list[int]) -> list[bytes]:
    bounds = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def responses(written: bytes) -> list[tuple[int, dict[str, Any]]]:
    """Every complete response written: (status, JSON body)."""
    out = []
    rest = written
    while rest:
        head, found, rest = rest.partition(b"\r\n\r\n")
        assert found, f"a response without the end of its head: {head[:200]!r}"
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.decode().lower().split(": ", 1) for line in lines[1:])
        assert headers.get("content-type") == "application/json", headers
        length = int(headers["content-length"])
        out.append((status, json.loads(rest[:length])))
        rest = rest[length:]
    return out


header_names = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)
header_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=400)
heads = st.lists(st.tuples(header_names, header_values), max_size=40)


def request(headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = [b"POST /v1/x HTTP/1.1", b"host: x", b"content-length: %d" % len(body)]
    lines += [f"{name}: {value}".encode() for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@FUZZ
@given(headers=heads, points=st.lists(st.integers(0, 1 << 20), max_size=30))
def test_a_head_of_any_size_and_count_is_answered_or_refused_with_431(headers: list[tuple[str, str]],
                                                                      points: list[int]) -> None:
    data = request(headers, b"{}")
    head_bytes = data.index(b"\r\n\r\n") + 4
    transport = run(cut(data, points))
    answers = responses(bytes(transport.written))
    if head_bytes > MAX_HEADER_BYTES or len(headers) + 2 > MAX_HEADERS:
        assert [status for status, _ in answers] == [431]
        assert answers[0][1]["error"]["code"] == "request_header_fields_too_large"
        assert transport.eof or transport.closing
    else:
        assert answers == [(200, {"path": "/v1/x", "headers": len(headers) + 2})]


@FUZZ
@given(count=st.integers(1, 6), bodies=st.lists(st.binary(max_size=50), min_size=6, max_size=6),
       points=st.lists(st.integers(0, 1 << 20), max_size=40))
def test_pipelined_requests_are_answered_in_order(count: int, bodies: list[bytes], points: list[int]) -> None:
    data = b"".join(request([("x-index", str(i))], bodies[i]) for i in range(count))
    answers = responses(bytes(run(cut(data, points)).written))
    assert [status for status, _ in answers] == [200] * count


@FUZZ
@given(garbage=st.binary(min_size=1, max_size=600), points=st.lists(st.integers(0, 1 << 20), max_size=20))
def test_garbage_never_raises_and_any_answer_is_json(garbage: bytes, points: list[int]) -> None:
    transport = run(cut(garbage, points))
    for status, body in responses(bytes(transport.written)):
        assert status in (200, 400, 431, 501), status
        if status != 200:
            assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_byte_at_a_time_head_is_bounded_like_one_sent_whole() -> None:
    data = request([("x-big", "a" * 4000)])
    transport = run([data[i:i + 1] for i in range(len(data))])
    assert [status for status, _ in responses(bytes(transport.written))] == [431]
