"""N simulated replicas in one process and one event loop, and the kvgate policy file that fronts them.

Replica i serves HTTP on ``port + i``, publishes KV events on ``zmq_port + 2i`` and answers replay on
``zmq_port + 2i + 1``. Replicas share the tokenizer and a registry of NIXL engine ids (the in-process side channel
KV transfers use).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterator

import yaml
import zmq.asyncio
from aiohttp import web

from .api import ReplicaApi, make_request
from .bootstrap import ReplicaBootstrap
from .engine import Engine, SimRequest
from .errors import EngineError
from .metrics import metrics_registry
from .model import SimModel
from .params import SimParams
from .publisher import EventPublisher

RECORDS_KEPT = 2000


class Replica:
    def __init__(
        self, fleet: "Fleet", index: int, host: str, http_port: int, zmq_port: int, params: SimParams,
        role: str = "both", bootstrap_port: int | None = None,
    ) -> None:
        self.fleet = fleet
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
        self.model = fleet.model
        self.healthy = True
        self.poison: bytes | None = None
        """Generation requests whose body holds these bytes are answered 500 (``/sim/fault`` poison)."""
        self.started_at = time.time()
        self.records: deque[SimRequest | dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self.errors = 0
        self._request_ids = itertools.count()
        self._id_prefix = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.publisher = EventPublisher(
            fleet.zmq_context, self.pub_endpoint, self.replay_endpoint, params.topic, params.replay_buffer_steps,
            random.Random(params.seed * 7919 + index),
        )
        self.engine = Engine(params, self.publisher.publish, self.model.output_vocab, fleet.engines, http_port)
        self.registry = metrics_registry(self)
        self.api = ReplicaApi(self)
        self.bootstrap = ReplicaBootstrap(self, bootstrap_port)
        self._web_server: web.Server | None = None
        self._listener: asyncio.base_events.Server | None = None
        self._engine_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.http_port}"

    async def start(self) -> None:
        self.publisher.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name=f"{self.name}-engine")
        await self.bootstrap.start()
        await self.start_http()

    async def close(self) -> None:
        await self.stop_http()
        await self.bootstrap.close()
        if self._engine_task is not None:
            self._engine_task.cancel()
            await asyncio.gather(self._engine_task, return_exceptions=True)
        await self.publisher.close()

    async def start_http(self) -> None:
        if self._listener is not None:
            return
        self._web_server = web.Server(
            self.api.handle, request_factory=make_request, handler_cancellation=True, access_log=None
        )
        self._listener = await asyncio.get_running_loop().create_server(
            self._web_server, self.host, self.http_port, reuse_address=True, backlog=1024
        )

    async def stop_http(self) -> None:
        """Close the listener and cut every open connection (clients see resets, then connection refused)."""
        if self._listener is None or self._web_server is None:
            return
        self._listener.close()
        for conn in list(self._web_server.connections):
            if conn.transport is not None:
                conn.transport.abort()
        await self._listener.wait_closed()
        self._listener = None
        self._web_server = None

    def next_request_id(self) -> str:
        """Internal request ids (NIXL's remote_request_id): unique per replica and process, cheap to make."""
        return f"{self._id_prefix}-{next(self._request_ids)}"

    def restart(self) -> None:
        """A fresh engine process: nothing of the old one survives, not even a fault it was put in. Its
        ``process_start_time_seconds`` changes, so a scraper can tell."""
        self.started_at = time.time()
        self.engine.restart()
        self.bootstrap.restart()
        self.engine.unstall()
        self.publisher.reset()
        self.healthy = True

    def record_error(self, request: web.BaseRequest, err: EngineError) -> None:
        self.errors += 1
        self.records.append({
            "request_id": None, "endpoint": request.path, "model": None, "stream": None, "cache_salt": None,
            "kv_transfer_params_in": None, "prompt_tokens": 0, "cached_tokens": 0, "transferred_tokens": 0,
            "status": "error", "error": err.message, "http_status": err.status, "queue_ms": None, "ttft_ms": None,
            "headers": {"x-request-id": request.headers.get("X-Request-Id"),
                        "x-session-id": request.headers.get("X-Session-ID")},
        })

    def stats(self) -> dict[str, Any]:
        p = self.publisher
        return {
            "replica": self.name, "role": self.role, "engine_id": self.engine.engine_id, "healthy": self.healthy,
            "stalled": self.engine.stalled, "http_listening": self._listener is not None,
            "clock_ms": self.engine.clock_ms, "running": len(self.engine.running),
            "waiting": len(self.engine.waiting), "kv_cache_usage": self.engine.pool.usage(),
            "gpu_cached_blocks": len(self.engine.pool.gpu), "cpu_cached_blocks": len(self.engine.pool.cpu),
            "evicted_blocks": self.engine.pool.evicted_blocks, "leases": len(self.engine.leases),
            "bad_requests": self.errors, **asdict(self.engine.stats), "itl": self.engine.itl.summary(),
            "bootstrap": self.bootstrap.summary(),
            "events": {"next_seq": p.next_seq, "buffered": len(p.buffer), "frames_sent": p.frames_sent,
                       "frames_dropped": p.frames_dropped, "drop_fraction": p.drop_fraction,
                       "delay_ms": p.delay_s * 1000.0, "replay_enabled": p.replay_enabled,
                       "replay_requests": p.replay_requests, "replay_invalid": p.replay_invalid},
        }


class Fleet:
    def __init__(
        self, replicas: int, host: str, port: int, zmq_port: int, params: SimParams, model: SimModel,
        roles: list[str] | None = None, bootstrap_port: int | None = None,
    ):
        """``roles``: each replica's role, in order (None: every replica serves both and the policy file names no
        role)."""
        if roles is not None and len(roles) != replicas:
            raise ValueError(f"{len(roles)} roles for {replicas} replicas")
        self.model = model
        self.params = params
        self.roles_given = roles is not None
        self.sglang = bootstrap_port is not None
        """The fleet speaks SGLang's P/D handoff: its prefill replicas (every replica, without roles) run a bootstrap
        server, and the policy file lists every replica as an sglang one."""
        self.zmq_context = zmq.asyncio.Context()
        self.engines: dict[str, Engine] = {}
        self.replicas = [
            Replica(self, i, host, port + i, zmq_port + 2 * i, replace(params), roles[i] if roles else "both",
                    None if bootstrap_port is None or (roles and roles[i] != "prefill") else bootstrap_port + i)
            for i in range(replicas)
        ]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    async def start(self) -> None:
        for r in self.replicas:
            await r.start()

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()
        self.zmq_context.term()

    def policy_file(self) -> dict[str, Any]:
        """kvgate's own config for this fleet (loads with ``kvgate.router.config.load_config``)."""
        return {
            "replicas": [
                {"name": r.name, "url": r.url, "kv_events": _client_endpoint(r.pub_endpoint),
                 "kv_replay": _client_endpoint(r.replay_endpoint), "kv_topic": self.params.topic,
                 **({"role": r.role} if self.roles_given else {}), **(_sglang_fields(r) if self.sglang else {})}
                for r in self.replicas
            ],
            "models": [{"name": self.params.model, "tokenizer": str(self.model.tokenizer_path),
                        "block_size": self.params.block_size}],
            "transfer": {"connector": "nixl"},
        }

    def write_policy_file(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.policy_file(), sort_keys=False))


def _sglang_fields(replica: Replica) -> dict[str, Any]:
    """An SGLang fleet's replica: its engine kind, and its bootstrap port when it is a prefill server
    (loadgen.sim.bootstrap)."""
    if replica.bootstrap.port is None:
        return {"engine": "sglang"}
    return {"engine": "sglang", "bootstrap_port": replica.bootstrap.port}


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "*") else host


def _client_endpoint(endpoint: str) -> str:
    host_port = endpoint.removeprefix("tcp://")
    host, _, port = host_port.rpartition(":")
    return f"tcp://{_client_host(host)}:{port}"
