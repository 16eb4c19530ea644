"""One simulated replica's engine-side state: its identity and addresses, its engine and KV-event publisher, and
what it has served.

The HTTP API (``api.py``), the SGLang bootstrap server (``bootstrap.py``), ``/metrics`` (``metrics.py``) and the
faults (``faults.py``) all read and change this state; ``fleet.py`` puts them together around it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import deque
from typing import Any

import zmq.asyncio
from aiohttp import web

from .engine import Engine, SimRequest
from .errors import EngineError
from .model import SimModel
from .params import SimParams
from .publisher import EventPublisher

RECORDS_KEPT = 2000


class SimReplica:
    """Replica ``index`` of a fleet: HTTP on ``http_port``, KV events published on ``zmq_port`` and replayed on
    ``zmq_port + 1``. ``engines`` is the fleet's registry of NIXL engine ids (the in-process side channel KV
    transfers use), shared by every replica."""

    def __init__(
        self, index: int, host: str, http_port: int, zmq_port: int, params: SimParams, model: SimModel,
        zmq_context: zmq.asyncio.Context, engines: dict[str, Engine], role: str = "both",
    ) -> None:
        self.index = index
        self.name = f"sim-{index}"
        self.role = role
        """``prefill``, ``decode`` or ``both``: what the policy file says this replica is for. A replica serves every
        request whatever its role (vLLM's ``kv_both``) and counts those off its role (``off_role_requests``)."""
        self.host = host
        self.http_port = http_port
        self.pub_endpoint = f"tcp://{host}:{zmq_port}"
        self.replay_endpoint = f"tcp://{host}:{zmq_port + 1}"
        self.params = params
        self.model = model
        self.healthy = True
        self.poison: bytes | None = None
        """Generation requests whose body holds these bytes are answered 500 (``/sim/fault`` poison)."""
        self.started_at = time.time()
        self.records: deque[SimRequest | dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self.errors = 0
        self._request_ids = itertools.count()
        self._id_prefix = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.publisher = EventPublisher(
            zmq_context, self.pub_endpoint, self.replay_endpoint, params.topic, params.replay_buffer_steps,
            random.Random(params.seed * 7919 + index),
        )
        self.engine = Engine(params, self.publisher.publish, model.output_vocab, engines, http_port)
        self._engine_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{client_host(self.host)}:{self.http_port}"

    def start_engine(self) -> None:
        """Start publishing KV events and run the engine's scheduler loop."""
        self.publisher.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name=f"{self.name}-engine")

    async def close_engine(self) -> None:
        """Stop the scheduler loop, then the publisher (its sockets are closed)."""
        if self._engine_task is not None:
            self._engine_task.cancel()
            await asyncio.gather(self._engine_task, return_exceptions=True)
        await self.publisher.close()

    def next_request_id(self) -> str:
        """Internal request ids (NIXL's remote_request_id): unique per replica and process, cheap to make."""
        return f"{self._id_prefix}-{next(self._request_ids)}"

    def record_error(self, request: web.BaseRequest, err: EngineError) -> None:
        self.errors += 1
        self.records.append({
            "request_id": None, "endpoint": request.path, "model": None, "stream": None, "cache_salt": None,
            "kv_transfer_params_in": None, "prompt_tokens": 0, "cached_tokens": 0, "transferred_tokens": 0,
            "status": "error", "error": err.message, "http_status": err.status, "queue_ms": None, "ttft_ms": None,
            "headers": request_headers(request),
        })


def request_headers(request: web.BaseRequest) -> dict[str, str | None]:
    """The request headers /sim/requests reports: the ids a router or client attaches (Claude Code names its
    session in ``x-claude-code-session-id``, which vLLM does not read), and the W3C trace context an engine started
    with ``--otlp-traces-endpoint`` would continue its trace from."""
    return {"x-request-id": request.headers.get("X-Request-Id"), "x-session-id": request.headers.get("X-Session-ID"),
            "x-claude-code-session-id": request.headers.get("x-claude-code-session-id"),
            "traceparent": request.headers.get("traceparent"), "tracestate": request.headers.get("tracestate")}


def client_host(host: str) -> str:
    """The address a client reaches a socket bound to ``host`` at (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "*") else host
