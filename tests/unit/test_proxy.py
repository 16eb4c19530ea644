"""kvgate.router.upstream.proxy against real loopback HTTP servers (aiohttp) standing in for engines."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from kvgate.router.routing.transfers import first_leg_body, prefill_for_transfer
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.proxy import (
    AttemptFailed,
    Forward,
    Proxy,
    StreamResult,
    create_session,
    first_byte_deadline_s,
    relay_stream,
    usage_of_body,
    usage_of_stream_tail,
)
from tests.support import free_port_block

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeTicket:
    first: bool = False
    finished: list[bool | None] = field(default_factory=list)
    blamed: bool = False

    def first_token(self) -> None:
        self.first = True

    def finish(self, ok: bool | None) -> None:
        if not self.finished:
            self.finished.append(ok)

    def blame(self) -> None:
        self.blamed = True


@dataclass
class FakeDispatcher:
    urls: dict[str, str]
    down: set[str] = field(default_factory=set)
    tickets: list[tuple[str, FakeTicket]] = field(default_factory=list)

    def url_of(self, name: str) -> str | None:
        return self.urls.get(name)

    def routable(self, name: str) -> bool:
        return name not in self.down

    def dispatch(self, name: str) -> FakeTicket:
        ticket = FakeTicket()
        self.tickets.append((name, ticket))
        return ticket


@pytest.fixture
async def engines() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Start loopback HTTP servers with one handler each; returns their base URLs."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port_block(1)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def causes() -> list[str]:
    """Retry causes the proxy reported."""
    return []


@pytest.fixture
async def proxy(causes: list[str]) -> AsyncIterator[Proxy]:
    config = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=0.5, backoff_base_ms=1, backoff_max_ms=2)
    session = create_session(config)
    yield Proxy(session, config, random.Random(0), on_retry=causes.append)
    await session.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port_block(1)}"


def forward(candidates: list[str], stream: bool = False, attempts: int = 3) -> Forward:
    return Forward("/v1/completions", b'{"model": "m", "prompt": "hi"}', {"content-type": "application/json"},
                   stream, candidates, attempts)


async def ok_json(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"echo": body, "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                       "prompt_tokens_details": {"cached_tokens": 4}}})


async def test_connection_refused_is_retried_on_the_next_replica(proxy: Proxy, engines, causes: list[str]) -> None:  # type: ignore[no-untyped-def]
    good = await engines(ok_json)
    d = FakeDispatcher({"dead": closed_port_url(), "good": good})
    up = await proxy.forward(forward(["dead", "good"]), d)
    assert up.replica == "good" and up.attempts == 2 and up.status == 200
    assert [(n, t.finished) for n, t in d.tickets] == [("dead", [False]), ("good", [])]
    assert d.tickets[1][1].first
    assert causes == ["connect"]
    assert usage_of_body(up.body) is not None and usage_of_body(up.body).cached_tokens == 4  # type: ignore[union-attr]


async def test_5xx_and_429_retry_then_the_last_failure_is_raised(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=503)

    d = FakeDispatcher({"a": await engines(busy), "b": await engines(broken)})
    with pytest.raises(AttemptFailed) as caught:
        await proxy.forward(forward(["a", "b"]), d)
    assert caught.value.status == 503 and json.loads(caught.value.body)["error"]["message"] == "boom"
    # A 429 is backpressure and a 5xx on every replica may be the request's own doing: nobody is blamed.
    assert [(t.finished, t.blamed) for _, t in d.tickets] == [([None], False), ([None], False)]


async def test_client_errors_are_returned_not_retried(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def bad(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)

    d = FakeDispatcher({"a": await engines(bad), "b": await engines(ok_json)})
    up = await proxy.forward(forward(["a", "b"]), d)
    assert up.replica == "a" and up.status == 400 and len(d.tickets) == 1


async def test_no_first_byte_in_time_is_a_retryable_timeout(proxy: Proxy, engines, causes: list[str]) -> None:  # type: ignore[no-untyped-def]
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # well past the 0.5 s first-byte timeout
        return web.json_response({})

    d = FakeDispatcher({"slow": await engines(slow), "good": await engines(ok_json)})
    up = await proxy.forward(forward(["slow", "good"]), d)
    assert up.replica == "good"
    assert causes == ["timeout"]


async def test_unroutable_retry_targets_are_skipped_and_attempts_are_bounded(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    d = FakeDispatcher({"a": closed_port_url(), "b": closed_port_url(), "c": closed_port_url(),
                        "d": await engines(ok_json)}, down={"b"})
    with pytest.raises(AttemptFailed) as caught:
        await proxy.forward(forward(["a", "b", "c", "d"], attempts=2), d)
    assert caught.value.cause == "connect"
    assert [n for n, _ in d.tickets] == ["a", "c"]


def sse(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]


async def collect(up, results: list[StreamResult]) -> bytes:  # type: ignore[no-untyped-def]
    out = b""
    async for chunk in relay_stream(up, results.append):
        out += chunk
    return out


async def test_stream_is_relayed_and_its_usage_read_from_the_tail(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def streaming(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in sse({"id": "x", "choices": [{"text": "a"}]}, {"id": "x", "choices": [{"text": "b"}]},
                        {"id": "x", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                                             "prompt_tokens_details": {"cached_tokens": 8}}}):
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    d = FakeDispatcher({"s": await engines(streaming)})
    up = await proxy.forward(forward(["s"], stream=True), d)
    assert up.body.startswith(b"data: ")
    results: list[StreamResult] = []
    out = await collect(up, results)
    assert out.count(b"data: ") == 4 and out.endswith(b"data: [DONE]\n\n")
    assert [r.end for r in results] == ["ok"]
    assert results[0].usage is not None and results[0].usage.cached_tokens == 8


async def test_upstream_dying_mid_stream_ends_with_an_error_event(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    first_chunk_read = asyncio.Event()

    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"id": "x", "choices": [{"text": "a"}]})[0])
        await asyncio.wait_for(first_chunk_read.wait(), 5)
        assert request.transport is not None
        request.transport.abort()
        return resp

    d = FakeDispatcher({"s": await engines(dies)})
    up = await proxy.forward(forward(["s"], stream=True), d)  # returns once the first chunk is read
    first_chunk_read.set()
    results: list[StreamResult] = []
    out = await collect(up, results)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "upstream_stream_error"
    assert [r.end for r in results] == ["stream_error"]


async def test_stream_closed_before_its_first_byte_is_retried(proxy: Proxy, engines, causes: list[str]) -> None:  # type: ignore[no-untyped-def]
    async def empty(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write_eof()
        return resp

    async def streaming(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    d = FakeDispatcher({"empty": await engines(empty), "good": await engines(streaming)})
    up = await proxy.forward(forward(["empty", "good"], stream=True), d)
    assert up.replica == "good"
    assert causes == ["disconnect"]


async def test_closing_the_relay_early_closes_the_upstream_connection(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    upstream_gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(sse({"id": "x", "choices": [{"text": "a"}]})[0])
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise

    d = FakeDispatcher({"s": await engines(endless)})
    up = await proxy.forward(forward(["s"], stream=True), d)
    results: list[StreamResult] = []
    relay = relay_stream(up, results.append)
    await relay.__anext__()
    await relay.__anext__()
    await relay.aclose()
    assert [r.end for r in results] == ["client_disconnect"]
    await asyncio.wait_for(upstream_gone.wait(), 5)


async def test_upstream_sockets_have_tcp_nodelay(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    socket_checked = asyncio.Event()

    async def held_body(request: web.Request) -> web.StreamResponse:
        """The body ends only after the test looked at the socket, so the connection is still the response's."""
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.wait_for(socket_checked.wait(), 5)
        await resp.write(b"done")
        return resp

    url = await engines(held_body)
    async with proxy.session.post(url + "/v1/completions", json={}) as resp:
        sock = resp.connection.transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        socket_checked.set()
        await resp.read()


async def test_transfer_first_leg_returns_the_sources_kv_transfer_params(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    seen: list[dict] = []

    async def source(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "request_id": request.headers.get("X-Request-Id")})
        return web.json_response({"choices": [], "kv_transfer_params": {"do_remote_prefill": True,
                                                                         "remote_engine_id": "e1"}})

    d = FakeDispatcher({"src": await engines(source)})
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "min_tokens": 5, "future_field": 1}
    params = await prefill_for_transfer(proxy, "/v1/completions", body, {"x-request-id": "rid-1"}, "src", d, 5.0)
    assert params == {"do_remote_prefill": True, "remote_engine_id": "e1"}
    sent = seen[0]["body"]
    assert sent["kv_transfer_params"]["do_remote_decode"] is True and sent["stream"] is False
    assert sent["max_tokens"] == 1 and "stream_options" not in sent and "min_tokens" not in sent
    assert sent["future_field"] == 1 and seen[0]["request_id"] == "rid-1"
    assert d.tickets[0][1].finished == [True]


async def test_transfer_first_leg_failure_means_recompute(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def no_params(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    d = FakeDispatcher({"dead": closed_port_url(), "plain": await engines(no_params)})
    body = {"model": "m", "prompt": "p"}
    assert await prefill_for_transfer(proxy, "/v1/completions", body, {}, "dead", d, 5.0) is None
    assert await prefill_for_transfer(proxy, "/v1/completions", body, {}, "plain", d, 5.0) is None


def test_first_byte_deadline_follows_the_predicted_ttft_between_floor_and_cap() -> None:
    config = ProxyConfig(first_byte_timeout_s=60, first_byte_floor_s=2, first_byte_ttft_multiplier=10,
                         first_byte_ms_per_output_token=100)
    assert first_byte_deadline_s(config, 30.0, True, None) == 2.0  # a short prompt: the floor
    assert first_byte_deadline_s(config, 800.0, True, None) == 8.0  # 10 x 0.8 s
    assert first_byte_deadline_s(config, 30_000.0, True, None) == 60.0  # never above the cap
    assert first_byte_deadline_s(config, None, True, None) == 60.0  # no prediction: the cap
    # Not streaming: the first byte comes after the decode, bounded only by max_tokens.
    assert first_byte_deadline_s(config, 30.0, False, 50) == pytest.approx(7.0)
    assert first_byte_deadline_s(config, 30.0, False, None) == 60.0
    assert first_byte_deadline_s(config, 30.0, False, 10_000) == 60.0


async def test_an_attempt_is_abandoned_at_its_own_deadline_and_retried(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    released = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await released.wait()
        return web.json_response({})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    d = FakeDispatcher({"hung": await engines(silent), "good": await engines(ok)})
    failures: list[tuple[str, str]] = []
    proxy.on_failure = lambda replica, cause: failures.append((replica, cause))
    asked: list[str] = []

    def deadline_s(replica: str) -> float:
        asked.append(replica)
        return 0.1 if replica == "hung" else 5.0

    fwd = Forward("/v1/completions", b"{}", {}, False, ["hung", "good"], 3, deadline_s)
    try:
        up = await proxy.forward(fwd, d)
    finally:
        released.set()
    assert up.replica == "good" and up.attempts == 2
    assert asked == ["hung", "good"] and failures == [("hung", "timeout")]
    # The timeout counts against "hung" once the same request succeeded on "good".
    assert [(t.finished, t.blamed) for _, t in d.tickets] == [([None], True), ([], False)]


def test_first_leg_body_caps_chat_completion_tokens_too() -> None:
    leg = first_leg_body({"model": "m", "messages": [], "max_completion_tokens": 100})
    assert leg["max_completion_tokens"] == 1 and leg["max_tokens"] == 1


def test_usage_from_stream_tail_takes_the_last_usage_event() -> None:
    tail = b"".join(sse({"choices": [], "usage": {"prompt_tokens": 1}},
                        {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}))
    tail += b"data: [DONE]\n\n"
    usage = usage_of_stream_tail(tail)
    assert usage is not None and usage.prompt_tokens == 5 and usage.cached_tokens is None
    assert usage_of_stream_tail(b"data: {broken\n\n") is None
    assert usage_of_body(b"not json") is None


async def test_session_passes_bodies_through_undecoded(engines) -> None:  # type: ignore[no-untyped-def]
    async def gz(request: web.Request) -> web.Response:
        return web.Response(body=b"\x1f\x8b-not-really", headers={"Content-Encoding": "gzip"})

    session = create_session(ProxyConfig())
    try:
        async with session.post(await engines(gz)) as resp:
            assert await resp.read() == b"\x1f\x8b-not-really"
    finally:
        await session.close()
    assert isinstance(session, aiohttp.ClientSession)


async def test_a_client_leaving_after_done_has_the_whole_answer(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    """The official openai client closes its response as soon as it reads ``[DONE]``, without waiting for the
    body's end. An upstream that ends its body a moment after ``[DONE]`` must still count as answered in full."""
    client_left = asyncio.Event()

    async def lingering(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"id": "x", "choices": [{"text": "a"}]})[0])
        await resp.write(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})[0])
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.wait_for(client_left.wait(), 5)
        return resp

    d = FakeDispatcher({"s": await engines(lingering)})
    up = await proxy.forward(forward(["s"], stream=True), d)
    results: list[StreamResult] = []
    relay = relay_stream(up, results.append)
    seen = b""
    while b"[DONE]" not in seen:
        seen += await relay.__anext__()
    await relay.aclose()
    client_left.set()
    assert [r.end for r in results] == ["ok"]
    assert results[0].usage is not None and results[0].usage.prompt_tokens == 9
