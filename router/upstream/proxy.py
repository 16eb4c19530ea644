"""One attempt of a request on one replica, through the gateway's :class:`~kvgate.router.upstream.client.EngineClient`.

An attempt ends in one of two ways: the response with its first output read (the whole body when not streaming), or
an :class:`AttemptFailed` naming why — the cause the retry and blame rules of :mod:`kvgate.router.fleet.attempts`
read. The proxy decides nothing and calls nothing above it: the replica's URL, the attempt's first-byte deadline
and what counts as a stream's first output come with the request (:class:`Forward`), as decided when it was routed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvgate.router.core.errors import ApiError
from kvgate.router.core.trace_context import AttemptTracing
from kvgate.router.upstream.client import (
    EngineClient, EngineResponse, UpstreamBodyTooLarge, UpstreamConnectError, UpstreamError,
)
from kvgate.router.upstream.config import ProxyConfig
from kvgate.router.upstream.first_token import read_to_first_output

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
     "proxy-authenticate", "proxy-authorization", "date", "server"}
)
"""Upstream response headers kvgate does not copy to the client (its own server sets framing and these)."""


class AttemptFailed(Exception):
    """One upstream attempt failed before any byte reached the client; another replica may be tried."""

    def __init__(self, cause: str, message: str, status: int | None = None, body: bytes = b"",
                 headers: Sequence[tuple[str, str]] = (), *, final: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status
        self.body = body
        self.headers = dict(headers)
        """The engine's answer's headers, names in lower case."""
        self.final = final
        """The request itself made the attempt fail (it asked for an answer too large to hold): every replica would
        fail it the same way, so none is tried after this one and none is blamed."""

    def to_api_error(self) -> ApiError:
        if self.cause == "timeout":
            return ApiError(504, f"upstream replica timed out: {self}", code="upstream_timeout")
        if self.cause == "answer_too_large":
            return ApiError(502, f"the replica's answer is too large: {self}", code="upstream_answer_too_large")
        return ApiError(502, f"upstream replica failed: {self}", code="upstream_error")


@dataclass(slots=True)
class Forward:
    """One client request to forward: the same bytes go to each replica tried, in ``candidates`` order."""

    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    candidates: Sequence[str]
    max_attempts: int
    deadlines_s: Mapping[str, float] | None = None
    """The first-byte deadline of an attempt on each replica (:func:`first_byte_deadline_s`, decided when the request
    was routed); a replica missing, or None: the configured cap, ``proxy.first_byte_timeout_s``."""
    holds_output: Callable[[bytes], bool] | None = None
    """Streaming: whether the answer's start holds its first output (the request's API's); None: its first byte."""
    method: str = "POST"
    trace: AttemptTracing | None = None
    """The traced request this is part of: each attempt is a span of it, whose context the engine gets."""
    on_sent: Callable[[], None] | None = None
    """Called once the first attempt's request is handed to its connection (not for a retry)."""


@dataclass(slots=True)
class Proxy:
    client: EngineClient
    config: ProxyConfig
    """Replaced on reload (:meth:`reconfigure`); read at each attempt."""

    def reconfigure(self, config: ProxyConfig) -> None:
        self.config = config

    async def attempt(
        self, url: str, fwd: Forward, first_byte_deadline_s: float, progressed_at: Callable[[], float] | None = None
    ) -> tuple[EngineResponse, bytes, float]:
        """Send ``fwd`` to ``url``: the response, its first output (streaming) or whole body, and the monotonic time
        that arrived. Raises :class:`AttemptFailed` for a refused or lost connection, no first byte within
        ``first_byte_deadline_s``, or a retryable status (5xx, 429).

        ``progressed_at``: when the replica last showed it is working (an answer's first output, a request served,
        its engine's finished counter moving). While it keeps doing so, a missed first-byte deadline is put off by
        another ``first_byte_deadline_s``, up to ``proxy.first_byte_timeout_s`` in all (:func:`while_working`): the
        request waits in a busy engine's queue, and leaving it would give up its place there and start its prefill
        over elsewhere."""
        if fwd.trace is not None:
            return await self._traced_attempt(url, fwd, first_byte_deadline_s, progressed_at)
        cfg = self.config
        response: EngineResponse | None = None
        sent = time.monotonic()
        extend = None
        if progressed_at is not None:
            extend = while_working(progressed_at, sent, first_byte_deadline_s, cfg.first_byte_timeout_s)
        try:
            # One deadline on the response: the first byte's (connecting included), then the whole answer's.
            response = await self.client.request(fwd.method, url, fwd.headers, fwd.body,
                                                 connect_timeout_s=cfg.connect_timeout_s,
                                                 timeout_s=first_byte_deadline_s, on_sent=fwd.on_sent, extend=extend)
            if response.status in RETRYABLE_STATUS:
                body = await response.read(cfg.max_answer_bytes)
                raise AttemptFailed(
                    f"status_{response.status}", f"HTTP {response.status}", response.status, body,
                    response.headers,
                )
            if fwd.stream and response.status == 200:
                first = (await response.readany() if fwd.holds_output is None
                         else await read_to_first_output(response, fwd.holds_output))
                if not first:
                    raise AttemptFailed("disconnect", "upstream closed the stream before its first byte")
                at = time.monotonic()
                response.set_timeout(cfg.total_timeout_s - (at - sent))
                return response, first, at
            response.set_timeout(cfg.total_timeout_s - (time.monotonic() - sent))
            body = await response.read(cfg.max_answer_bytes)
            return response, body, time.monotonic()
        except AttemptFailed:
            if response is not None:
                response.close()
            raise
        except TimeoutError as e:
            if response is not None:
                response.close()
            raise AttemptFailed("timeout", f"no first byte within {first_byte_deadline_s:.1f} s") from e
        except UpstreamConnectError as e:
            raise AttemptFailed("connect", str(e)) from e
        except UpstreamBodyTooLarge as e:  # closed by the read
            raise AttemptFailed("answer_too_large", str(e), final=True) from e
        except (UpstreamError, OSError) as e:
            if response is not None:
                response.close()
            raise AttemptFailed("disconnect", f"{type(e).__name__}: {e}") from e
        except BaseException:
            if response is not None:
                response.close()
            raise

    async def _traced_attempt(
        self, url: str, fwd: Forward, first_byte_deadline_s: float, progressed_at: Callable[[], float] | None
    ) -> tuple[EngineResponse, bytes, float]:
        """The attempt in its own span, told how it went: the request carries the span's trace context (and no
        trace of its own, so it is sent as an untraced one)."""
        assert fwd.trace is not None
        span = fwd.trace.attempt(url, fwd.method)
        untraced = dataclasses.replace(fwd, headers=span.headers(fwd.headers), trace=None)
        try:
            response, body, at = await self.attempt(url, untraced, first_byte_deadline_s, progressed_at)
        except AttemptFailed as failed:
            span.failed(failed.cause, failed.status)
            raise
        except BaseException:
            span.abandoned()
            raise
        span.answered(response.status, streaming=fwd.stream and response.status == 200)
        return response, body, at


def while_working(
    progressed_at: Callable[[], float], sent: float, window_s: float, cap_s: float
) -> Callable[[], float | None]:
    """An attempt's deadline extension (:meth:`EngineResponse.set_timeout`): when its deadline passes, another
    ``window_s`` if the replica showed progress (``progressed_at``) within the window that just ended, none past
    ``cap_s`` from ``sent``. A hung engine answers nothing, so its attempts still end at their first deadline; a
    busy one answers others' requests while this one waits its turn."""

    def extend() -> float | None:
        now = time.monotonic()
        left_s = sent + cap_s - now
        if left_s <= 0 or progressed_at() <= now - window_s:
            return None
        return min(window_s, left_s)

    return extend


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
