"""A request's attempts on the fleet: tried on the replicas of its plan in order until one answers, each attempt's
load put on its replica (a :class:`~kvgate.router.fleet.tickets.LoadTicket`), and what each failure says about the
replica told to its breaker.

Retry rule: an attempt may be retried on the next replica only while nothing has reached the client — connection
refused or reset, no response headers (or, when streaming, no first output) within the attempt's first-byte
deadline (put off while the replica keeps answering other requests: the request is queued there, not lost;
:func:`~kvgate.router.upstream.proxy.while_working`), or a 5xx/429 answer. A non-streaming body is read whole
before anything is sent, so it is retryable until it is complete. A replica that stopped taking requests since the
plan was made is skipped.

Blame rule: a refused connection counts against the replica's breaker at once (nothing the client sent can cause
it). A timeout, a reset or a 5xx may be the request's own doing (a prompt that crashes or stalls the engine, fields
it rejects badly), so it counts only once the same request succeeded on another replica; a request that fails
everywhere, or that another replica refuses with a 4xx, blames nobody. A 429 is backpressure, never a fault. An
answer too large to hold (``proxy.max_answer_bytes``) is what the request asked for: it ends the request with a 502,
retried nowhere, blaming nobody.
Once a streamed chunk has been sent, a failure ends the stream with an error event instead (the relay's,
:mod:`kvgate.router.pipeline.relay`): a retry would duplicate text the client already has.

Everything an attempt needs comes with the request as data (:class:`~kvgate.router.upstream.proxy.Forward`: the
replicas in order, each one's deadline; :class:`Load`: the prefill each one would take on): this module calls the
proxy and the fleet, nothing above them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.state import Fleet
from kvgate.router.fleet.tickets import LoadTicket
from kvgate.router.upstream.client import EngineResponse
from kvgate.router.upstream.proxy import HOP_BY_HOP, AttemptFailed, Forward, Proxy


@dataclass(frozen=True, slots=True)
class Load:
    """What a dispatch of this request puts on a replica: its uncached prompt tokens there (``prefill_tokens``; a
    replica missing: none, as for embeddings), and whose request it is (``caller``, the tenant: the breaker counts
    failures by caller)."""

    prefill_tokens: Mapping[str, int] = field(default_factory=dict)
    caller: str | None = None


NO_LOAD = Load()


@dataclass(slots=True)
class Upstream:
    """A successful attempt: the replica's response, ready to be relayed to the client."""

    replica: str
    response: EngineResponse
    body: bytes
    """Non-streaming: the whole body. Streaming: the first chunk (already read, not yet sent)."""
    ticket: LoadTicket
    attempts: int
    sent_at: float
    """Monotonic time this attempt was sent: the engine's time on the request is counted from it."""
    first_byte_at: float
    """Monotonic time the first output (streaming: as the request's ``holds_output`` says) or the whole body
    (non-streaming) arrived."""

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def engine_ms(self) -> float:
        """The engine's time on the request as the gateway sees it: from this attempt's dispatch to its first byte."""
        return (self.first_byte_at - self.sent_at) * 1000.0

    def settle(self) -> None:
        """The answer is over: the replica served it, unless the engine refused the request (a 4xx), which says
        nothing about the replica."""
        self.ticket.finish(True if self.status < 400 else None)

    def client_headers(self) -> dict[str, str]:
        """The upstream's end-to-end headers, to copy to the client."""
        return {name: value for name, value in self.response.headers if name not in HOP_BY_HOP}


class Attempts:
    def __init__(self, proxy: Proxy, fleet: Fleet, metrics: GatewayMetrics,
                 rng: random.Random | None = None) -> None:
        self.proxy = proxy
        self.fleet = fleet
        self.metrics = metrics
        self.rng = rng or random.Random()

    async def forward(self, fwd: Forward, load: Load = NO_LOAD) -> Upstream:
        """Try ``fwd.candidates`` in order until one answers; raise the last failure as an :class:`ApiError`-able
        :class:`AttemptFailed` when none does. A non-retryable answer (e.g. an engine's 400) is returned as is."""
        last: AttemptFailed | None = None
        unblamed: list[LoadTicket] = []
        """Attempts that failed in a way the request itself may have caused: blamed only if another one succeeds."""
        attempts = 0
        replicas = self.fleet.replicas
        for name in fwd.candidates:
            if attempts >= fwd.max_attempts:
                break
            replica = replicas.get(name)
            if replica is None or (attempts > 0 and not replica.routable()):
                continue
            if attempts > 0:
                assert last is not None
                self.metrics.retries.labels(last.cause).inc()
                await asyncio.sleep(self._backoff_s(attempts))
                if fwd.on_sent is not None:
                    fwd = dataclasses.replace(fwd, on_sent=None)  # told of the first attempt only
            attempts += 1
            ticket = self.fleet.dispatch(name, load.prefill_tokens.get(name, 0), load.caller)
            deadline_s = self.proxy.config.first_byte_timeout_s
            if fwd.deadlines_s is not None:
                deadline_s = fwd.deadlines_s.get(name, deadline_s)
            sent_at = time.monotonic()
            try:
                response, body, first_byte_at = await self.proxy.attempt(
                    replica.url + fwd.path, fwd, deadline_s, lambda: replica.progressed_at)
            except AttemptFailed as failed:
                replica_fault = failed.cause == "connect"
                ticket.finish(False if replica_fault else None)
                self.metrics.upstream_failures.labels(name, failed.cause).inc()
                if failed.final:
                    raise
                if not replica_fault and failed.cause != "status_429":
                    unblamed.append(ticket)
                last = failed
                continue
            except BaseException:
                ticket.finish(None)
                raise
            ticket.first_token()
            replica.progressed_at = first_byte_at
            if first_byte_at - sent_at > deadline_s:
                self.metrics.waits_past_deadline.labels(name).inc()
            if response.status < 400:
                for failed_ticket in unblamed:
                    failed_ticket.blame()
            return Upstream(name, response, body, ticket, attempts, sent_at, first_byte_at)
        if last is None:
            raise AttemptFailed("no_replica", "no routable replica")
        raise last

    def _backoff_s(self, retry: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(retry-1))]."""
        config = self.proxy.config
        cap = min(config.backoff_max_ms, config.backoff_base_ms * (2 ** (retry - 1)))
        return self.rng.uniform(0.0, cap) / 1000.0
