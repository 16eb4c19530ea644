"""Operator endpoints under ``/admin``: list, add, drain, undrain and remove replicas, and reload the policy file.
The replica list also says, per model, whether kvgate's token counts agree with the engines' (the parity monitor), and
whether the engines finish more requests than this gateway and its peers sent them (``blind``: other callers it
cannot see, :mod:`kvgate.router.fleet.blindness`).

All of them need ``Authorization: Bearer <admin token>`` (``server.admin_token``, or env ``KVGATE_ADMIN_TOKEN``; see
:mod:`kvgate.router.core.auth`); with no token configured the admin surface does not exist (404), so a forgotten setting
never leaves it open. Bodies are read and validated here rather than by FastAPI's parameter binding, so the token is
checked before anything about the body is revealed, within the same deadline as every body and
:data:`MAX_ADMIN_BODY_BYTES`, and errors come back in OpenAI's shape like every other kvgate error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse

from kvgate.router.core.auth import Credentials
from kvgate.router.core.errors import ApiError
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet
from kvgate.router.gateway import Gateway
from kvgate.router.pipeline.bodies import parse_body, read_body
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import format_validation_error

MAX_ADMIN_BODY_BYTES = 65536
"""An admin body is one replica's settings: far less than this."""
MAX_STATE_REPLICAS = 128
"""Replicas ``/admin/state`` lists (``replicas_total`` says how many there are): with the caps below, each takes
under 2 KiB, so the dump stays within a few hundred KiB however large the fleet."""
MAX_STATE_STREAMS = 8
"""Event streams (data-parallel ranks) listed per replica."""
MAX_STATE_PEERS = 32
"""Peer gateways listed, freshest report first."""


def build_admin_router(
    fleet: Fleet, holder: ConfigHolder, parity: ParityMonitor, state: Callable[[], dict[str, Any]]
) -> APIRouter:
    router = APIRouter(prefix="/admin")

    def authorize(request: Request) -> None:
        """The token in force: the policy file's (reloadable), else the environment's."""
        Credentials.of(holder.current.server).require_admin(request.headers.get("authorization"))

    def replica_or_404(name: str) -> Replica:
        replica = fleet.replicas.get(name)
        if replica is None:
            raise ApiError(404, f"No replica named {name!r}.", param="name", code="replica_not_found")
        return replica

    @router.get("/replicas")
    async def list_replicas(request: Request) -> JSONResponse:
        authorize(request)
        models = parity.state()
        data = []
        for replica in fleet.replicas.values():
            status = replica_status(fleet, replica)
            status["parity"] = {m: models[m]["trusted"] for m in status["models"] if m in models}
            data.append(status)
        return JSONResponse({"object": "list", "data": data, "parity": models,
                             "blind": fleet.blindness.state(fleet.clock())})

    @router.get("/state")
    async def dump_state(request: Request) -> JSONResponse:
        """Everything behind the routing decisions, counted (:func:`state_dump`)."""
        authorize(request)
        return JSONResponse(state())

    @router.post("/replicas")
    async def add_replica(request: Request) -> JSONResponse:
        authorize(request)
        raw = await read_body(request, MAX_ADMIN_BODY_BYTES, holder.current.server.body_timeout_s, None)
        try:
            cfg = ReplicaConfig.model_validate(parse_body(raw))
        except ValidationError as e:
            raise ApiError(422, format_validation_error(e), code="invalid_value") from e
        try:
            replica = fleet.add(cfg)
        except ValueError as e:
            raise ApiError(409, str(e), param="name", code="replica_exists") from e
        return JSONResponse(replica_status(fleet, replica), status_code=201)

    @router.post("/replicas/{name}/{action}")
    async def drain_or_undrain(name: str, action: str, request: Request) -> JSONResponse:
        """``drain``: no new requests go to the replica; ``undrain``: they may again."""
        authorize(request)
        if action not in ("drain", "undrain"):
            raise ApiError(404, f"No admin action {action!r}.", code="not_found")
        replica = replica_or_404(name)
        (fleet.drain if action == "drain" else fleet.undrain)(name)
        return JSONResponse(replica_status(fleet, replica))

    @router.delete("/replicas/{name}")
    async def remove_replica(name: str, request: Request) -> JSONResponse:
        authorize(request)
        replica_or_404(name)
        await fleet.remove(name)
        return JSONResponse({"name": name, "deleted": True})

    @router.post("/reload")
    async def reload_config(request: Request) -> JSONResponse:
        authorize(request)
        if not holder.reload():
            raise ApiError(400, f"Config rejected, previous config stays in force: {holder.last_error}",
                           code="config_rejected")
        return JSONResponse(
            {"reloaded": True, "reloads_ok": holder.reloads_ok, "reloads_rejected": holder.reloads_rejected}
        )

    return router


def replica_status(fleet: Fleet, replica: Replica) -> dict[str, Any]:
    """What an operator wants to see about one replica (also the admin API's response body)."""
    scraped = fleet.fresh_scrape(replica)
    return {
        "name": replica.name,
        "url": replica.url,
        "engine": replica.config.engine,
        "role": replica.config.role,
        "bootstrap_port": replica.config.bootstrap_port,
        "labels": dict(replica.config.labels),
        "healthy": replica.healthy,
        "draining": replica.draining,
        "routable": replica.routable(),
        "breaker": replica.breaker.state,
        "generation": replica.generation,
        "in_flight": replica.in_flight,
        "in_flight_prefill_tokens": replica.in_flight_prefill_tokens,
        "in_flight_prefilling": replica.in_flight_prefilling,
        "arrival_rate_per_s": round(fleet.arrival_rate_per_s(replica), 3),
        "unseen_request_rate_per_s": round(fleet.unseen_rate_per_s(replica), 3),
        "scraped": None
        if scraped is None
        else {
            "waiting": scraped.waiting,
            "running": scraped.running,
            "kv_usage": scraped.kv_usage,
            "block_size": scraped.block_size,
            "age_ms": round((fleet.clock() - scraped.at) * 1000.0, 1),
        },
        "models": [m["id"] for m in replica.served_models],
    }


def state_dump(gateway: Gateway) -> dict[str, Any]:
    """``/admin/state``: per replica what the cost policy sees of it (:func:`replica_status`), what the index holds
    there by tier and where its KV-event streams stand; the index's and the event ingestor's totals; the peers whose
    reports count and their age; the blindness signal; requests waiting at admission by band. Counts and
    configuration only, never prompt text, token ids or block keys; every list is capped (``MAX_STATE_*``)."""
    fleet = gateway.fleet
    replicas = list(fleet.replicas.values())
    rows = []
    for replica in replicas[:MAX_STATE_REPLICAS]:
        row = replica_status(fleet, replica)
        row["index"] = gateway.index.holdings(replica.name)
        row["events"] = gateway.ingestor.stream_state(replica.name, MAX_STATE_STREAMS)
        rows.append(row)
    ingest = gateway.ingestor.stats
    exchange = gateway.hints.exchange
    hints = gateway.holder.current.peers.hints
    waiting: dict[str, int] = {}
    for (band, _tenant), count in gateway.admission.depth():
        waiting[str(band)] = waiting.get(str(band), 0) + count
    return {
        "replicas_total": len(replicas),
        "replicas": rows,
        "index": dataclasses.asdict(gateway.index.stats()),
        "events": {
            "events_applied": ingest.events_applied, "frames_applied": ingest.frames_applied,
            "dropped": dict(ingest.dropped), "gaps_detected": ingest.gaps_detected,
            "replays_requested": ingest.replays_requested, "replays_succeeded": ingest.replays_succeeded,
            "replays_failed": ingest.replays_failed, "purges": ingest.purges, "restarts": ingest.restarts,
            "resets": dict(ingest.resets),
        },
        "peers": {
            "hints_bound": bool(hints.bind), "connected_endpoints": len(hints.connect),
            "reporting": [{"instance": sender, "report_age_s": round(age, 3)}
                          for sender, age in exchange.work.report_ages(MAX_STATE_PEERS)],
            "reporting_total": exchange.work.peers(),
            "stats": dataclasses.asdict(exchange.stats),
        },
        "blind": fleet.blindness.state(fleet.clock()),
        "admission_waiting": waiting,
    }
