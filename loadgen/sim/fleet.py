"""N simulated replicas in one process and one event loop, and the kvgate policy file that fronts them.

Replica i serves HTTP on ``port + i``, publishes KV events on ``zmq_port + 2i`` and answers replay on
``zmq_port + 2i + 1``. Replicas share the tokenizer and a registry of NIXL engine ids (the in-process side channel
KV transfers use).

Each replica is its state (``replica.SimReplica``) and a ``ReplicaServer`` around it: the HTTP listener serving
``api.ReplicaApi``, the ``/metrics`` page and the SGLang bootstrap server. This module is where they are put
together: each part is handed what it needs of the rest of the fleet (another replica's bootstrap server, the target
of a fault), so none of the parts imports this module.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
import zmq.asyncio
from aiohttp import web

from . import faults
from .api import ReplicaApi, make_request
from .bootstrap import ReplicaBootstrap
from .engine import Engine
from .metrics import MetricsPage
from .model import SimModel
from .params import SimParams
from .replica import SimReplica, client_host


class ReplicaServer:
    """One replica as the fleet runs it: its state, its HTTP listener, its metrics page and its bootstrap side.
    ``fleet`` is every server of the fleet (this one included): where a fault or a decode leg finds another
    replica."""

    def __init__(self, replica: SimReplica, bootstrap_port: int | None, fleet: Iterable[ReplicaServer]) -> None:
        self.replica = replica
        self._fleet = fleet
        self.metrics_page = MetricsPage(replica)
        self.bootstrap = ReplicaBootstrap(replica, bootstrap_port, self._peer_bootstrap)
        self.api = ReplicaApi(replica, self.bootstrap, self.metrics_page, self.stats, self._apply_fault)
        self._web_server: web.Server | None = None
        self._listener: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.replica.start_engine()
        await self.bootstrap.start()
        await self.start_http()

    async def close(self) -> None:
        await self.stop_http()
        await self.bootstrap.close()
        await self.replica.close_engine()

    async def start_http(self) -> None:
        if self._listener is not None:
            return
        self._web_server = web.Server(
            self.api.handle, request_factory=make_request, handler_cancellation=True, access_log=None
        )
        self._listener = await asyncio.get_running_loop().create_server(
            self._web_server, self.replica.host, self.replica.http_port, reuse_address=True, backlog=1024
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

    def restart(self) -> None:
        """A fresh engine process: nothing of the old one survives, not even a fault it was put in. Its
        ``process_start_time_seconds`` changes, so a scraper can tell."""
        r = self.replica
        r.started_at = time.time()
        r.engine.restart()
        self.bootstrap.restart()
        self.api.responses_api.restart()
        r.engine.unstall()
        r.publisher.reset()
        r.healthy = True

    def stats(self) -> dict[str, Any]:
        r = self.replica
        p = r.publisher
        return {
            "replica": r.name, "role": r.role, "engine_id": r.engine.engine_id, "healthy": r.healthy,
            "stalled": r.engine.stalled, "http_listening": self._listener is not None,
            "clock_ms": r.engine.clock_ms, "running": len(r.engine.running),
            "waiting": len(r.engine.waiting), "kv_cache_usage": r.engine.pool.usage(),
            "gpu_cached_blocks": len(r.engine.pool.gpu), "cpu_cached_blocks": len(r.engine.pool.cpu),
            "evicted_blocks": r.engine.pool.evicted_blocks, "leases": len(r.engine.leases),
            "bad_requests": r.errors, **asdict(r.engine.stats), "itl": r.engine.itl.summary(),
            "bootstrap": self.bootstrap.summary(),
            "events": {"next_seq": p.next_seq, "buffered": len(p.buffer), "frames_sent": p.frames_sent,
                       "frames_dropped": p.frames_dropped, "drop_fraction": p.drop_fraction,
                       "delay_ms": p.delay_s * 1000.0, "replay_enabled": p.replay_enabled,
                       "replay_requests": p.replay_requests, "replay_invalid": p.replay_invalid},
        }

    async def _apply_fault(self, body: dict[str, Any]) -> tuple[dict[str, Any], faults.After | None]:
        return await faults.apply(self, self._fleet, body)

    def _peer_bootstrap(self, name: str) -> ReplicaBootstrap | None:
        return next((s.bootstrap for s in self._fleet if s.replica.name == name), None)


class SimFleet:
    """``replicas`` simulated replicas sharing one ZMQ context and one registry of NIXL engine ids."""

    def __init__(
        self, replicas: int, host: str, port: int, zmq_port: int, params: SimParams, model: SimModel,
        roles: list[str] | None = None, bootstrap_port: int | None = None,
    ) -> None:
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
        self.servers = [
            ReplicaServer(
                SimReplica(i, host, port + i, zmq_port + 2 * i, replace(params), model, self.zmq_context, self.engines,
                           roles[i] if roles else "both"),
                None if bootstrap_port is None or (roles and roles[i] != "prefill") else bootstrap_port + i,
                self,
            )
            for i in range(replicas)
        ]

    def __iter__(self) -> Iterator[ReplicaServer]:
        return iter(self.servers)

    async def start(self) -> None:
        for s in self.servers:
            await s.start()

    async def close(self) -> None:
        for s in self.servers:
            await s.close()
        self.zmq_context.term()

    def policy_file(self) -> dict[str, Any]:
        """kvgate's policy file for this fleet (what ``kvgate serve --config`` reads)."""
        return {
            "replicas": [
                {"name": s.replica.name, "url": s.replica.url, "kv_events": _client_endpoint(s.replica.pub_endpoint),
                 "kv_replay": _client_endpoint(s.replica.replay_endpoint), "kv_topic": self.params.topic,
                 **({"role": s.replica.role} if self.roles_given else {}),
                 **(_sglang_fields(s.bootstrap) if self.sglang else {})}
                for s in self.servers
            ],
            "models": [{"name": self.params.model, "tokenizer": str(self.model.tokenizer_path),
                        "block_size": self.params.block_size}],
            "transfer": {"connector": "nixl"},
        }

    def write_policy_file(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.policy_file(), sort_keys=False))


def _sglang_fields(bootstrap: ReplicaBootstrap) -> dict[str, Any]:
    """An SGLang fleet's replica: its engine kind, and its bootstrap port when it is a prefill server
    (loadgen.sim.bootstrap)."""
    if bootstrap.port is None:
        return {"engine": "sglang"}
    return {"engine": "sglang", "bootstrap_port": bootstrap.port}


def _client_endpoint(endpoint: str) -> str:
    host_port = endpoint.removeprefix("tcp://")
    host, _, port = host_port.rpartition(":")
    return f"tcp://{client_host(host)}:{port}"
