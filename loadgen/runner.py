"""Send a workload to an OpenAI-compatible endpoint and record what every request experienced.

Open loop: each request is sent at its arrival time whether or not earlier ones finished (a chat session's later
turns wait for the previous turn, plus think time); a concurrency cap bounds how many are in flight, and a request
that waits for a slot is recorded with its arrival and its actual start. Every request streams, through the API
family the run names (``loadgen/apis.py``: chat completions, Anthropic Messages or OpenAI Responses), and the
engine's own prompt/cached token counts come back in the stream's usage.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvgate.loadgen.apis import Api, Wire, wire_for
from kvgate.loadgen.workloads.request import Request

REPLICA_HEADER = "x-kvgate-replica"
DECISION_HEADER = "x-kvgate-decision"


@dataclass(slots=True)
class RequestRecord:
    """What one request experienced. Times are seconds since the run started."""

    index: int
    endpoint: str
    """The workload's endpoint (chat or completions); the run's ``api`` says which front door chat requests took."""
    session_id: str | None
    arrival_s: float
    start_s: float
    expected_prompt_tokens: int
    oracle_hit_tokens: int
    end_s: float = 0.0
    first_token_s: float | None = None
    status: int = 0
    """HTTP status; 0 when no response arrived (connection error, timeout)."""
    error: str | None = None
    replica: str | None = None
    decision: str | None = None
    upstream_id: str | None = None
    """The request id the engine answered under (the stream's ``id`` less its ``chatcmpl-``/``cmpl-`` prefix; a
    Responses answer's id is its own, so none there): a router that sets its own X-Request-Id upstream
    (vllm-router does) is still matched to the engine's records."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    engine_ttft_ms: float | None = None
    """TTFT on the simulated engine's model clock (queue + prefill as modelled, unscaled ms); filled in by
    ``kvgate bench`` from the sim's /sim/requests, so it is free of this machine's CPU noise. A request served in
    two legs (a prefill replica, then a decode replica pulling its KV) adds both legs' TTFT."""
    engine_itl_ms: list[float] = field(default_factory=list)
    """Gaps between generated tokens on the engine clock of the replica that streamed the answer (unscaled ms);
    filled in like ``engine_ttft_ms``."""
    engine_queue_ms: float | None = None
    """Time in the engine's waiting queue on its model clock (one-leg requests only); filled in like
    ``engine_ttft_ms``."""
    engine_load_ms: float | None = None
    """Of ``engine_ttft_ms``, the time its cached tiers' blocks took to load back (one-leg requests only)."""
    engine_interference_ms: float | None = None
    """The waiting its prefill imposed on the other requests of its replica, on the engine's clock
    (:func:`~kvgate.loadgen.interference.imposed_waits`; one-leg requests only)."""
    predicted_ttft_ms: float | None = None
    """kvgate's predicted TTFT for the request on the replica that served it, from its request log line (None for
    other routers, and for policies that price no replica)."""
    predicted_queue_ms: float | None = None
    """The queue delay within ``predicted_ttft_ms``."""
    predicted_load_ms: float | None = None
    """The load of cached tiers within ``predicted_ttft_ms`` (requests routed where the policy priced them)."""
    predicted_interference_ms: float | None = None
    """The delay kvgate predicted its prefill would impose on the replica's other arrivals (same requests)."""
    gateway_ttft_ms: float | None = None
    """kvgate's own TTFT for the request (wall clock, from its arrival at the gateway), from its request log line."""
    upstream_ttft_ms: float | None = None
    """The part of ``gateway_ttft_ms`` after kvgate dispatched the request to the replica that answered (wall clock);
    the rest was kvgate's (its queue, tokenizing, routing) and, for a request served in two legs, the first leg."""
    retry_after: str | None = None
    """A refusal's ``Retry-After`` header, when it carried one."""
    id_prefix: str = "loadgen"

    @property
    def request_id(self) -> str:
        return f"{self.id_prefix}-{self.index}"

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunConfig:
    target: str
    model: str
    concurrency: int = 256
    duration_s: float | None = None
    """Stop sending new requests this long after the start (requests in flight still finish)."""
    timeout_s: float = 600.0
    progress: bool = True
    spread: tuple[str, ...] = ()
    """More base URLs serving the same fleet (gateway replicas): each request goes to one of ``target`` and these,
    chosen at random (seeded), as a Service spreads requests over its pods."""
    api: Api = "chat"
    """The API family chat requests go through (completion requests always use ``/v1/completions``)."""
    headers: tuple[tuple[str, str], ...] = ()
    """Headers sent with every request (a tenant's API key, say)."""
    id_prefix: str = "loadgen"
    """Request ids are ``<id_prefix>-<index>``: runs sent side by side to one gateway keep theirs apart."""


async def run_workload(requests: list[Request], config: RunConfig) -> tuple[list[RequestRecord], float]:
    """Send every request (within the duration bound); return the records in index order and the run's wall time."""
    runner = _Runner(requests, config)
    return await runner.run()


class _Runner:
    def __init__(self, requests: list[Request], config: RunConfig):
        self.requests = requests
        self.config = config
        self.followers: dict[int, list[Request]] = {}
        for r in requests:
            if r.after is not None:
                self.followers.setdefault(r.after, []).append(r)
        self.records: list[RequestRecord] = []
        self.slots = asyncio.Semaphore(config.concurrency)
        self.tasks: set[asyncio.Task[None]] = set()
        self.t0 = 0.0
        self.errors = 0
        self._targets = [url.rstrip("/") for url in (config.target, *config.spread)]
        self._pick = random.Random(0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> tuple[list[RequestRecord], float]:
        connector = aiohttp.TCPConnector(limit=self.config.concurrency, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn())
        with Progress(*columns, disable=not self.config.progress, transient=True) as progress:
            self.progress = progress
            self.bar = progress.add_task(self.config.target, total=len(self.requests), errors=0)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                self.session = session
                self.t0 = time.monotonic()
                for r in self.requests:
                    if r.after is None:
                        self._spawn(r, r.arrival_s)
                while self.tasks:
                    await asyncio.gather(*list(self.tasks))
        wall = self.now()
        return sorted(self.records, key=lambda rec: rec.index), wall

    def _spawn(self, request: Request, at_s: float) -> None:
        if self.config.duration_s is not None and at_s > self.config.duration_s:
            return
        task = asyncio.create_task(self._one(request, at_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, request: Request, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self.now()))
        wire = wire_for(request, self.config.api)
        async with self.slots:
            record = RequestRecord(
                request.index, request.endpoint, request.session_id, at_s, self.now(),
                request.prompt_tokens, request.oracle_hit_tokens, id_prefix=self.config.id_prefix,
            )
            await self._send(request, record, wire)
            record.end_s = self.now()
        self.records.append(record)
        self.errors += not record.ok
        self.progress.update(self.bar, advance=1, errors=self.errors)
        for follower in self.followers.get(request.index, []):
            self._spawn(follower, record.end_s + follower.arrival_s)

    async def _send(self, request: Request, record: RequestRecord, wire: Wire) -> None:
        body = wire.body(request, self.config.model)
        headers = {"X-Request-Id": record.request_id, **dict(self.config.headers), **wire.headers(request)}
        url = self._targets[self._pick.randrange(len(self._targets))] + wire.path
        try:
            async with self.session.post(url, json=body, headers=headers) as resp:
                record.status = resp.status
                record.replica = resp.headers.get(REPLICA_HEADER)
                record.decision = resp.headers.get(DECISION_HEADER)
                if resp.status != 200:
                    record.retry_after = resp.headers.get("retry-after")
                    record.error = (await resp.text())[:500] or resp.reason
                    return
                await self._read_stream(resp, record, wire)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: an over-long SSE line
            record.error = f"{type(e).__name__}: {e}"

    async def _read_stream(self, resp: aiohttp.ClientResponse, record: RequestRecord, wire: Wire) -> None:
        """TTFT is the first event carrying generated text; each later one adds an inter-token gap."""
        last_token_s: float | None = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank lines, and the ``event:`` lines that name each Messages and Responses event
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = wire.read(json.loads(data))
            except ValueError:
                record.error = f"malformed SSE data: {data[:200]!r}"
                return
            if event.error is not None:
                record.error = event.error
                return
            if record.upstream_id is None and event.upstream_id is not None:
                record.upstream_id = event.upstream_id
            if event.text:
                now = self.now()
                if last_token_s is None:
                    record.first_token_s = now
                else:
                    record.itl_s.append(now - last_token_s)
                last_token_s = now
            if event.usage is not None:
                record.prompt_tokens = event.usage.prompt_tokens
                record.output_tokens = event.usage.output_tokens
                record.cached_tokens = event.usage.cached_tokens
            if event.done:
                return
        record.error = f"stream ended without {wire.last_event}"
