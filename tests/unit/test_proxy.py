"""A request's attempts (kvgate.router.fleet.attempts, through kvgate.router.upstream.proxy and its
:class:`~kvgate.router.upstream.client.EngineClient`) on a real fleet, against real loopback HTTP servers (aiohttp)
standing in for engines."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from kvgate.router.apis.openai import CHAT, COMPLETIONS, usage_of_body, usage_of_stream_tail
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.attempts import NO_LOAD, Attempts
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.state import Fleet
from kvgate.router.fleet.tickets import LoadTicket
from kvgate.router.pipeline.relay import RelayStream, StreamResult
from kvgate.router.routing.transfers import first_leg_body, prefill_for_transfer
from kvgate.router.upstream.config import BreakerConfig, HealthConfig, ProxyConfig, ScrapeConfig
from kvgate.router.upstream.client import EngineClient
from kvgate.router.upstream.proxy import AttemptFailed, Forward, Proxy, first_byte_deadline_s, while_working
from tests.support import free_port_block, wait_until_async

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class TicketSpy:
    """A real load ticket, and what the attempts told it."""

    ticket: LoadTicket
    first: bool = False
    finished: list[bool | None] = field(default_factory=list)
    blamed: bool = False

    def first_token(self) -> None:
        self.first = True
        self.ticket.first_token()

    def finish(self, ok: bool | None) -> None:
        if not self.finished:
            self.finished.append(ok)
        self.ticket.finish(ok)

    def blame(self) -> None:
        self.blamed = True
        self.ticket.blame()


@dataclass
class FleetOn:
    """A real fleet of replicas at these URLs, its attempts, and every ticket they were dispatched with."""

    attempts: Attempts
    metrics: GatewayMetrics
    tickets: list[tuple[str, TicketSpy]] = field(default_factory=list)

    def counted(self, metric: Any) -> list[tuple[str, ...]]:
        """Each label set of a counter, once per count."""
        return [tuple(sample.labels.values()) for family in metric.collect() for sample in family.samples
                if sample.name.endswith("_total") for _ in range(int(sample.value))]

    @property
    def retry_causes(self) -> list[str]:
        return [cause for (cause,) in self.counted(self.metrics.retries)]

    @property
    def failures(self) -> list[tuple[str, ...]]:
        return self.counted(self.metrics.upstream_failures)


def fleet_on(proxy: Proxy, urls: dict[str, str], down: frozenset[str] = frozenset()) -> FleetOn:
    """Replicas ``urls`` (name: base URL), healthy but for ``down``."""
    replicas = [ReplicaConfig(name=name, url=url) for name, url in urls.items()]
    fleet = Fleet(replicas, proxy.client, health=HealthConfig(), scrape=ScrapeConfig(), breaker=BreakerConfig())
    for name, replica in fleet.replicas.items():
        replica.healthy = name not in down
    metrics = GatewayMetrics()
    spied = FleetOn(Attempts(proxy, fleet, metrics, random.Random(0)), metrics)
    dispatch = fleet.dispatch

    def dispatch_and_record(name: str, prefill_tokens: int, caller: str | None = None) -> LoadTicket:
        spy = TicketSpy(dispatch(name, prefill_tokens, caller))
        spied.tickets.append((name, spy))
        return spy  # type: ignore[return-value]  # a LoadTicket in all it is asked

    fleet.dispatch = dispatch_and_record  # type: ignore[method-assign]
    return spied


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
async def proxy() -> AsyncIterator[Proxy]:
    config = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=0.5, backoff_base_ms=1, backoff_max_ms=2)
    client = EngineClient(config.pool_size_per_replica)
    yield Proxy(client, config)
    await client.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port_block(1)}"


def forward(candidates: list[str], stream: bool = False, attempts: int = 3) -> Forward:
    return Forward("/v1/completions", b'{"model": "m", "prompt": "hi"}', {"content-type": "application/json"},
                   stream, candidates, attempts)


async def ok_json(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"echo": body, "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                       "prompt_tokens_details": {"cached_tokens": 4}}})


async def test_connection_refused_is_retried_on_the_next_replica(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    good = await engines(ok_json)
    d = fleet_on(proxy, {"dead": closed_port_url(), "good": good})
    up = await d.attempts.forward(forward(["dead", "good"]))
    assert up.replica == "good" and up.attempts == 2 and up.status == 200
    assert [(n, t.finished) for n, t in d.tickets] == [("dead", [False]), ("good", [])]
    assert d.tickets[1][1].first
    assert d.retry_causes == ["connect"]
    assert usage_of_body(up.body) is not None and usage_of_body(up.body).cached_tokens == 4  # type: ignore[union-attr]


async def test_5xx_and_429_retry_then_the_last_failure_is_raised(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=503)

    d = fleet_on(proxy, {"a": await engines(busy), "b": await engines(broken)})
    with pytest.raises(AttemptFailed) as caught:
        await d.attempts.forward(forward(["a", "b"]))
    assert caught.value.status == 503 and json.loads(caught.value.body)["error"]["message"] == "boom"
    # A 429 is backpressure and a 5xx on every replica may be the request's own doing: nobody is blamed.
    assert [(t.finished, t.blamed) for _, t in d.tickets] == [([None], False), ([None], False)]


async def test_client_errors_are_returned_not_retried(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def bad(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)

    d = fleet_on(proxy, {"a": await engines(bad), "b": await engines(ok_json)})
    up = await d.attempts.forward(forward(["a", "b"]))
    assert up.replica == "a" and up.status == 400 and len(d.tickets) == 1


async def test_an_answer_too_large_to_hold_fails_the_request_on_no_other_replica(engines) -> None:  # type: ignore[no-untyped-def]
    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 200_000, content_type="application/json")

    async def huge_error(request: web.Request) -> web.Response:
        return web.Response(body=b"e" * 200_000, status=503, content_type="application/json")

    config = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=2.0, max_answer_bytes=100_000)
    client = EngineClient(config.pool_size_per_replica)
    try:
        proxy = Proxy(client, config)
        for handler in (huge, huge_error):
            d = fleet_on(proxy, {"a": await engines(handler), "b": await engines(ok_json)})
            with pytest.raises(AttemptFailed) as caught:
                await d.attempts.forward(forward(["a", "b"]))
            assert caught.value.cause == "answer_too_large" and caught.value.to_api_error().status == 502
            # the request asked for it: retried nowhere, and the replica is not blamed
            assert [(n, t.finished, t.blamed) for n, t in d.tickets] == [("a", [None], False)]
        # a request within the bound on the same replicas goes through
        d = fleet_on(proxy, {"b": await engines(ok_json)})
        assert (await d.attempts.forward(forward(["b"]))).status == 200
    finally:
        await client.close()


async def test_no_first_byte_in_time_is_a_retryable_timeout(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # well past the 0.5 s first-byte timeout
        return web.json_response({})

    d = fleet_on(proxy, {"slow": await engines(slow), "good": await engines(ok_json)})
    up = await d.attempts.forward(forward(["slow", "good"]))
    assert up.replica == "good"
    assert d.retry_causes == ["timeout"]


async def test_unroutable_retry_targets_are_skipped_and_attempts_are_bounded(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    d = fleet_on(proxy, {"a": closed_port_url(), "b": closed_port_url(), "c": closed_port_url(),
                        "d": await engines(ok_json)}, down=frozenset({"b"}))
    with pytest.raises(AttemptFailed) as caught:
        await d.attempts.forward(forward(["a", "b", "c", "d"], attempts=2))
    assert caught.value.cause == "connect"
    assert [n for n, _ in d.tickets] == ["a", "c"]


def sse(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]


class Written:
    """A streamed answer's body as the server would write it (:class:`~kvgate.router.core.http.BodyWriter`): the
    chunks, in order, and how its source was held."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.flow: tuple[Callable[[], None], Callable[[], None]] | None = None

    def write(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    def hold_source(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self.flow = (pause, resume)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


async def collect(up, results: list[StreamResult]) -> bytes:  # type: ignore[no-untyped-def]
    out = Written()
    relay = RelayStream(up, CHAT, results.append)
    try:
        await asyncio.wait_for(relay.write_to(out), 5)
    finally:
        await relay.aclose()
    return out.data


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

    d = fleet_on(proxy, {"s": await engines(streaming)})
    up = await d.attempts.forward(forward(["s"], stream=True))
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

    d = fleet_on(proxy, {"s": await engines(dies)})
    up = await d.attempts.forward(forward(["s"], stream=True))  # returns once the first chunk is read
    first_chunk_read.set()
    results: list[StreamResult] = []
    out = await collect(up, results)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "upstream_stream_error"
    assert [r.end for r in results] == ["stream_error"]


async def test_stream_closed_before_its_first_byte_is_retried(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
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

    d = fleet_on(proxy, {"empty": await engines(empty), "good": await engines(streaming)})
    up = await d.attempts.forward(forward(["empty", "good"], stream=True))
    assert up.replica == "good"
    assert d.retry_causes == ["disconnect"]


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

    d = fleet_on(proxy, {"s": await engines(endless)})
    up = await d.attempts.forward(forward(["s"], stream=True))
    results: list[StreamResult] = []
    relay = RelayStream(up, CHAT, results.append)
    out = Written()
    writing = asyncio.ensure_future(relay.write_to(out))
    await wait_until_async(lambda: len(out.chunks) >= 2, "two chunks relayed", timeout=5)
    writing.cancel()  # the client left: the server cancels the writing, then closes the relay
    await asyncio.gather(writing, return_exceptions=True)
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
    resp = await proxy.client.request("POST", url + "/v1/completions", body=b"{}", connect_timeout_s=1.0)
    connection = resp._connection
    assert connection is not None and connection.transport is not None
    sock = connection.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    socket_checked.set()
    assert await resp.read() == b"done"


async def test_transfer_first_leg_returns_the_sources_kv_transfer_params(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    seen: list[dict] = []

    async def source(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "request_id": request.headers.get("X-Request-Id")})
        return web.json_response({"choices": [], "kv_transfer_params": {"do_remote_prefill": True,
                                                                         "remote_engine_id": "e1"}})

    d = fleet_on(proxy, {"src": await engines(source)})
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "min_tokens": 5, "future_field": 1}
    params = await prefill_for_transfer(d.attempts, COMPLETIONS, body, {"x-request-id": "rid-1"}, "src", NO_LOAD, 5.0)
    assert params == {"do_remote_prefill": True, "remote_engine_id": "e1"}
    sent = seen[0]["body"]
    assert sent["kv_transfer_params"]["do_remote_decode"] is True and sent["stream"] is False
    assert sent["max_tokens"] == 1 and "stream_options" not in sent and "min_tokens" not in sent
    assert sent["future_field"] == 1 and seen[0]["request_id"] == "rid-1"
    assert d.tickets[0][1].finished == [True]


async def test_transfer_first_leg_failure_means_recompute(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    async def no_params(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    d = fleet_on(proxy, {"dead": closed_port_url(), "plain": await engines(no_params)})
    body = {"model": "m", "prompt": "p"}
    assert await prefill_for_transfer(d.attempts, COMPLETIONS, body, {}, "dead", NO_LOAD, 5.0) is None
    assert await prefill_for_transfer(d.attempts, COMPLETIONS, body, {}, "plain", NO_LOAD, 5.0) is None


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

    d = fleet_on(proxy, {"hung": await engines(silent), "good": await engines(ok)})
    deadlines = AskedDeadlines({"hung": 0.1, "good": 5.0})  # the route stage's plan
    asked = deadlines.asked
    fwd = Forward("/v1/completions", b"{}", {}, False, ["hung", "good"], 3, deadlines)
    try:
        up = await d.attempts.forward(fwd)
    finally:
        released.set()
    assert up.replica == "good" and up.attempts == 2
    assert asked == ["hung", "good"] and d.failures == [("hung", "timeout")]
    # The timeout counts against "hung" once the same request succeeded on "good".
    assert [(t.finished, t.blamed) for _, t in d.tickets] == [([None], True), ([], False)]


async def busy_replica_run(proxy: Proxy, engines, release_after_s: float) -> tuple[FleetOn, object]:  # type: ignore[no-untyped-def]
    """A request held by replica "busy" (deadline 0.2 s; "spare" next) for ``release_after_s``, while "busy" answers
    other requests every 20 ms: the attempts' result (an :class:`Upstream`, or the exception raised)."""
    released = asyncio.Event()
    held = asyncio.Event()

    async def busy(request: web.Request) -> web.Response:
        if (await request.json()).get("prompt") == "held":
            held.set()
            await released.wait()
        return web.json_response({"ok": True})

    d = fleet_on(proxy, {"busy": await engines(busy), "spare": await engines(ok_json)})
    held_fwd = Forward("/v1/completions", b'{"prompt": "held"}', {}, False, ["busy", "spare"], 3,
                       {"busy": 0.2, "spare": 5.0})
    waiting = asyncio.create_task(d.attempts.forward(held_fwd))
    await asyncio.wait_for(held.wait(), 5.0)
    until = time.monotonic() + release_after_s
    while time.monotonic() < until and not waiting.done():  # "busy" serves others meanwhile
        assert (await d.attempts.forward(forward(["busy"]))).replica == "busy"
        await asyncio.sleep(0.02)
    released.set()
    outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
    return d, outcome


async def test_a_replica_that_answers_others_keeps_a_request_past_its_deadline(engines) -> None:  # type: ignore[no-untyped-def]
    config = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=5.0, backoff_base_ms=1, backoff_max_ms=2)
    client = EngineClient(config.pool_size_per_replica)
    try:
        d, up = await busy_replica_run(Proxy(client, config), engines, release_after_s=0.7)
    finally:
        await client.close()
    # Answered where it waited, three deadlines later: no retry, nothing blamed, its wait counted.
    assert getattr(up, "replica", up) == "busy" and up.attempts == 1  # type: ignore[attr-defined]
    assert d.failures == [] and d.retry_causes == []
    assert d.counted(d.metrics.waits_past_deadline) == [("busy",)]


async def test_a_busy_replica_still_loses_a_request_at_the_cap(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    d, up = await busy_replica_run(proxy, engines, release_after_s=2.0)  # the cap is 0.5 s
    assert getattr(up, "replica", up) == "spare" and up.attempts == 2  # type: ignore[attr-defined]
    assert d.failures == [("busy", "timeout")]


def test_a_deadline_is_put_off_only_for_progress_within_it_and_never_past_the_cap() -> None:
    now = time.monotonic()
    sent = now - 1.0  # the first 1 s deadline passes now
    assert while_working(lambda: now - 1.5, sent, 1.0, 10.0)() is None  # nothing since it was sent
    assert while_working(lambda: now - 0.5, sent, 1.0, 10.0)() == 1.0  # answered another: one deadline more
    assert while_working(lambda: now - 0.5, sent, 1.0, 1.4)() == pytest.approx(0.4, abs=0.05)  # up to the cap
    assert while_working(lambda: now - 0.5, sent, 1.0, 0.9)() is None  # past the cap


class AskedDeadlines(dict[str, float]):
    """A plan of deadlines that records which replicas' the proxy read."""

    def __init__(self, deadlines: dict[str, float]) -> None:
        super().__init__(deadlines)
        self.asked: list[str] = []

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        self.asked.append(key)
        return super().get(key, default)


def test_first_leg_body_caps_chat_completion_tokens_too() -> None:
    leg = first_leg_body(CHAT, {"model": "m", "messages": [], "max_completion_tokens": 100})
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

    async with EngineClient(4) as client:
        resp = await client.request("POST", await engines(gz), body=b"{}", connect_timeout_s=1.0)
        assert await resp.read() == b"\x1f\x8b-not-really"
        assert resp.header("content-encoding") == "gzip"


async def test_a_relay_closed_before_its_first_chunk_still_reports_its_end(proxy: Proxy, engines) -> None:  # type: ignore[no-untyped-def]
    """A client that leaves before its stream was started: the server only closes the relay, which must still let
    go of the upstream and say how the stream ended (its load ticket and its request log line depend on that)."""
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while True:
            await resp.write(sse({"id": "x", "choices": [{"text": "a"}]})[0])
            await asyncio.sleep(0.01)

    d = fleet_on(proxy, {"s": await engines(endless)})
    up = await d.attempts.forward(forward(["s"], stream=True))
    results: list[StreamResult] = []
    await RelayStream(up, CHAT, results.append).aclose()
    assert [r.end for r in results] == ["client_disconnect"]
    assert up.response.complete is False and up.response._connection is None


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

    d = fleet_on(proxy, {"s": await engines(lingering)})
    up = await d.attempts.forward(forward(["s"], stream=True))
    results: list[StreamResult] = []
    relay = RelayStream(up, CHAT, results.append)
    out = Written()
    writing = asyncio.ensure_future(relay.write_to(out))
    await wait_until_async(lambda: b"[DONE]" in out.data, "the end marker relayed", timeout=5)
    writing.cancel()  # the client read [DONE] and left before the upstream's body ended
    await asyncio.gather(writing, return_exceptions=True)
    await relay.aclose()
    client_left.set()
    assert [r.end for r in results] == ["ok"]
    assert results[0].usage is not None and results[0].usage.prompt_tokens == 9
