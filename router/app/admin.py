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

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse

from kvgate.router.core.auth import Credentials
from kvgate.router.core.errors import ApiError
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet
from kvgate.router.pipeline.bodies import parse_body, read_body
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import format_validation_error

MAX_ADMIN_BODY_BYTES = 65536
"""An admin body is one replica's settings: far less than this."""


def build_admin_router(fleet: Fleet, holder: ConfigHolder, parity: ParityMonitor) -> APIRouter:
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
