"""Upstream HTTP to engine replicas: one shared aiohttp session, bounded retries, and a stream relay.

Why aiohttp and not httpx: a proxy spends several times less CPU per request in aiohttp's ClientSession than in
httpx's client; the bare FastAPI + aiohttp proxy of ``benchmarks/bench_overhead.py`` (docs/benchmarks.md, "Router
overhead") is that floor. aiohttp keeps connections alive per host and sets TCP_NODELAY on every socket it opens
(``aiohttp.base_protocol``), so streamed chunks are never held back by Nagle.

Retry rule: an attempt may be retried on the next replica only while nothing has reached the client — connection
refused or reset, no response headers (or, when streaming, no first token) within the attempt's first-byte deadline
(:func:`first_byte_deadline_s`), or a 5xx/429 answer. A non-streaming body is read whole before anything is sent,
so it is retryable until it is complete.

Blame rule: a refused connection counts against the replica's breaker at once (nothing the client sent can cause
it). A timeout, a reset or a 5xx may be the request's own doing (a prompt that crashes or stalls the engine, fields
it rejects badly), so it counts only once the same request succeeded on another replica; a request that fails
everywhere, or that another replica refuses with a 4xx, blames nobody. A 429 is backpressure, never a fault.
Once a streamed chunk has been sent, a failure ends the stream with an OpenAI-style error event instead: a retry
would duplicate text the client already has.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvgate.router.http.errors import ApiError
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.first_token import read_to_first_token

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
     "proxy-authenticate", "proxy-authorization", "date", "server"}
)
"""Upstream response headers kvgate does not copy to the client (its own server sets framing and these)."""

StreamEnd = Literal["ok", "stream_error", "client_disconnect"]


def create_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """The one upstream session of a gateway: a keep-alive pool per replica, bodies passed through undecoded."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=config.pool_size_per_replica, keepalive_timeout=60.0)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


class Ticket(Protocol):
    """The fleet's load ticket for one dispatched attempt (:class:`kvgate.router.fleet.state.LoadTicket`)."""

    def first_token(self) -> None: ...

    def finish(self, ok: bool | None) -> None: ...

    def blame(self) -> None: ...


class Dispatcher(Protocol):
    """What the proxy needs from the fleet: where a replica lives, whether it takes requests, load accounting."""

    def url_of(self, name: str) -> str | None: ...

    def routable(self, name: str) -> bool: ...

    def dispatch(self, name: str) -> Ticket: ...


class AttemptFailed(Exception):
    """One upstream attempt failed before any byte reached the client; another replica may be tried."""

    def __init__(self, cause: str, message: str, status: int | None = None, body: bytes = b"",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status
        self.body = body
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        """The engine's answer's headers, names in lower case."""

    def to_api_error(self) -> ApiError:
        if self.cause == "timeout":
            return ApiError(504, f"upstream replica timed out: {self}", code="upstream_timeout")
        return ApiError(502, f"upstream replica failed: {self}", code="upstream_error")


@dataclass(slots=True)
class Upstream:
    """A successful attempt: the replica's response, ready to be relayed to the client."""

    replica: str
    response: aiohttp.ClientResponse
    body: bytes
    """Non-streaming: the whole body. Streaming: the first chunk (already read, not yet sent)."""
    ticket: Ticket
    attempts: int
    first_byte_at: float
    """Monotonic time the first token (streaming: past a role-only chat chunk, see :mod:`router.upstream.first_token`)
    or the whole body (non-streaming) arrived."""

    @property
    def status(self) -> int:
        return self.response.status

    def settle(self) -> None:
        """The answer is over: the replica served it, unless the engine refused the request (a 4xx), which says
        nothing about the replica."""
        self.ticket.finish(True if self.status < 400 else None)

    def client_headers(self) -> dict[str, str]:
        """The upstream's end-to-end headers, to copy to the client."""
        return {k.lower(): v for k, v in self.response.headers.items() if k.lower() not in HOP_BY_HOP}


@dataclass(slots=True)
class Forward:
    """One client request to forward: the same bytes go to each replica tried, in ``candidates`` order."""

    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    candidates: Sequence[str]
    max_attempts: int
    first_byte_deadline_s: Callable[[str], float] | None = None
    """The first-byte deadline of an attempt on a replica (:func:`first_byte_deadline_s`); None: the configured cap,
    ``proxy.first_byte_timeout_s``."""


@dataclass(slots=True)
class Proxy:
    session: aiohttp.ClientSession
    config: ProxyConfig
    """Replaced on reload; read at each attempt."""
    rng: random.Random = field(default_factory=random.Random)
    on_retry: Callable[[str], None] = lambda cause: None
    on_failure: Callable[[str, str], None] = lambda replica, cause: None
    """Called with (replica, cause) for every attempt that failed before any byte reached the client."""

    async def forward(self, fwd: Forward, dispatcher: Dispatcher) -> Upstream:
        """Try ``fwd.candidates`` in order until one answers; raise the last failure as an :class:`ApiError`-able
        :class:`AttemptFailed` when none does. A non-retryable answer (e.g. an engine's 400) is returned as is."""
        last: AttemptFailed | None = None
        unblamed: list[Ticket] = []
        """Attempts that failed in a way the request itself may have caused: blamed only if another one succeeds."""
        attempts = 0
        for name in fwd.candidates:
            if attempts >= fwd.max_attempts:
                break
            url = dispatcher.url_of(name)
            if url is None or (attempts > 0 and not dispatcher.routable(name)):
                continue
            if attempts > 0:
                assert last is not None
                self.on_retry(last.cause)
                await asyncio.sleep(self._backoff_s(attempts))
            attempts += 1
            ticket = dispatcher.dispatch(name)
            deadline_s = self.config.first_byte_timeout_s
            if fwd.first_byte_deadline_s is not None:
                deadline_s = fwd.first_byte_deadline_s(name)
            try:
                response, body, first_byte_at = await self._attempt(url + fwd.path, fwd, deadline_s)
            except AttemptFailed as failed:
                replica_fault = failed.cause == "connect"
                ticket.finish(False if replica_fault else None)
                if not replica_fault and failed.cause != "status_429":
                    unblamed.append(ticket)
                self.on_failure(name, failed.cause)
                last = failed
                continue
            except BaseException:
                ticket.finish(None)
                raise
            ticket.first_token()
            if response.status < 400:
                for failed_ticket in unblamed:
                    failed_ticket.blame()
            return Upstream(name, response, body, ticket, attempts, first_byte_at)
        if last is None:
            raise AttemptFailed("no_replica", "no routable replica")
        raise last

    def _backoff_s(self, retry: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(retry-1))]."""
        cap = min(self.config.backoff_max_ms, self.config.backoff_base_ms * (2 ** (retry - 1)))
        return self.rng.uniform(0.0, cap) / 1000.0

    async def _attempt(
        self, url: str, fwd: Forward, first_byte_deadline_s: float
    ) -> tuple[aiohttp.ClientResponse, bytes, float]:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, sock_connect=cfg.connect_timeout_s)
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(first_byte_deadline_s):
                response = await self.session.post(url, data=fwd.body, headers=fwd.headers, timeout=timeout)
                if response.status in RETRYABLE_STATUS:
                    body = await response.read()
                    raise AttemptFailed(
                        f"status_{response.status}", f"HTTP {response.status}", response.status, body,
                        response.headers,
                    )
                if fwd.stream and response.status == 200:
                    first = await read_to_first_token(response.content)
                    if not first:
                        raise AttemptFailed("disconnect", "upstream closed the stream before its first byte")
                    return response, first, time.monotonic()
            body = await response.read()
            return response, body, time.monotonic()
        except AttemptFailed:
            if response is not None:
                response.close()
            raise
        except TimeoutError as e:
            if response is not None:
                response.close()
            raise AttemptFailed("timeout", f"no first byte within {first_byte_deadline_s:.1f} s") from e
        except aiohttp.ClientConnectorError as e:
            raise AttemptFailed("connect", f"cannot connect: {e.os_error}") from e
        except (aiohttp.ClientError, OSError) as e:
            if response is not None:
                response.close()
            raise AttemptFailed("disconnect", f"{type(e).__name__}: {e}") from e
        except BaseException:
            if response is not None:
                response.close()
            raise


def first_byte_deadline_s(
    config: ProxyConfig, predicted_ttft_ms: float | None, stream: bool, max_tokens: int | None
) -> float:
    """How long an attempt may wait for its first byte before it is abandoned (and retried elsewhere).

    A replica that accepts connections and never answers (a hung engine, a stopped process) is only found out by a
    deadline, and a flat one makes every request sent there wait the longest prefill anyone could have. The
    deadline follows the cost model's predicted TTFT for this request on this replica, queue included:
    ``first_byte_ttft_multiplier`` × prediction, at least ``first_byte_floor_s`` (predictions are estimates, and a
    short prompt's is a few milliseconds). A non-streaming answer arrives whole, after its decode: each token of
    ``max_tokens`` adds ``first_byte_ms_per_output_token``, and without ``max_tokens`` nothing bounds the decode
    but the cap. Never more than ``first_byte_timeout_s``, nor when there is no prediction.
    """
    cap = config.first_byte_timeout_s
    if predicted_ttft_ms is None or (not stream and max_tokens is None):
        return cap
    deadline_s = max(config.first_byte_floor_s, config.first_byte_ttft_multiplier * predicted_ttft_ms / 1000.0)
    if not stream:
        deadline_s += max(max_tokens or 0, 0) * config.first_byte_ms_per_output_token / 1000.0
    return min(cap, deadline_s)


class _UsageDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _UsageDetails | None = None


class _UsageCarrier(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


def usage_of_body(body: bytes) -> Usage | None:
    """``usage`` of a non-streaming OpenAI response (typed decode: other fields are skipped, not built)."""
    try:
        carrier = _usage_decoder.decode(body)
    except msgspec.DecodeError:
        return None
    return _usage(carrier)


def usage_of_stream_tail(tail: bytes) -> Usage | None:
    """``usage`` of the last SSE event that carries one (``stream_options.include_usage``), from the stream's tail."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = _usage(_usage_decoder.decode(line[6:]))
            except msgspec.DecodeError:
                continue
            if usage is not None:
                return usage
    return None


def _usage(carrier: _UsageCarrier) -> Usage | None:
    u = carrier.usage
    if u is None:
        return None
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
    return Usage(u.prompt_tokens, u.completion_tokens, cached)


@dataclass(slots=True)
class StreamResult:
    end: StreamEnd
    usage: Usage | None
    finished_at: float


TAIL_BYTES = 16384


async def relay_stream(upstream: Upstream, on_end: Callable[[StreamResult], None]) -> AsyncIterator[bytes]:
    """Yield the upstream's SSE bytes to the client as they arrive, chunk by chunk (no buffering).

    After the first byte nothing is retried: an upstream failure appends an error event and ``[DONE]``. When the
    client leaves (the generator is closed or cancelled), the upstream connection is closed at once so the engine
    aborts the sequence. A client that leaves once ``[DONE]`` has been relayed had the whole answer: the official
    openai client closes its response on reading it, often before the upstream's body has ended, so that ends
    ``ok``. ``on_end`` is called exactly once with how the stream ended and the usage seen in its tail.
    """
    resp = upstream.response
    end: StreamEnd = "client_disconnect"
    prev = b""
    last = upstream.body
    try:
        yield last
        try:
            async for chunk in resp.content.iter_any():
                prev, last = last, chunk
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            end = "stream_error"
            yield ApiError(502, f"upstream replica failed mid-stream: {type(e).__name__}",
                           code="upstream_stream_error").sse_event()
            return
        tail = prev[-TAIL_BYTES:] + last
        if b"[DONE]" not in tail and resp.content_type == "text/event-stream":
            end = "stream_error"
            yield ApiError(502, "upstream replica ended the stream early", code="upstream_stream_error").sse_event()
            return
        end = "ok"
    finally:
        if end == "ok":
            resp.release()
        else:
            resp.close()
        tail = prev[-TAIL_BYTES:] + last
        if end == "client_disconnect" and b"data: [DONE]" in tail:
            end = "ok"
        usage = usage_of_stream_tail(tail) if end == "ok" else None
        on_end(StreamResult(end, usage, time.monotonic()))


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` when the client closes the connection. Only for requests whose body was already read, so
    ``receive`` has nothing else to report. Run it as a task next to the work it guards."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def left_early(watcher: asyncio.Task[None]) -> bool:
    """Whether a :func:`cancel_on_disconnect` watcher is what cancelled its task (the client left)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


class RelayResponse(Response):
    """Streams a relay (:func:`relay_stream`) to the client and always finalises it when the ASGI call ends (done,
    cancelled, or the client disconnected), instead of leaving the generator to the garbage collector: the upstream
    is closed at once.

    Not Starlette's StreamingResponse: under uvicorn's ASGI spec 2.3 that runs every stream in an anyio task group
    with a second task listening for the disconnect. Here one watcher task cancels the stream instead, which costs
    less CPU per response and ends the relay just as promptly."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: Mapping[str, str]) -> None:
        self.body_iterator = chunks
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(cancel_on_disconnect(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left_early(watcher):
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
