"""Operator endpoints under ``/admin``: list, add, drain, undrain and remove replicas, and reload the policy file.
The replica list also says, per model, whether kvgate's token counts agree with the engines' (the parity monitor), and
whether the engines finish more requests than this gateway and its peers sent them (``blind``: other callers it
cannot see, :mod:`kvgate.router.fleet.blindness`).

All of them need ``Authorization: Bearer <admin token>`` (``server.admin_token``, or env ``KVGATE_ADMIN_TOKEN``; see
:mod:`kvgate.router.core.auth`); with no token configured the admin surface does not exist (404), so a forgotten setting
never leaves it open. The token is checked before anything about the body is revealed; a body is read within the same
deadline as every body and :data:`MAX_ADMIN_BODY_BYTES`, and errors come back in OpenAI's shape like every other
kvgate error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from kvgate.cache_index.match import PrefixMatch
from kvgate.router.admission.gate import NO_TENANT
from kvgate.router.app.routes import Routes
from kvgate.router.core.auth import Credentials
from kvgate.router.core.errors import ApiError, json_response
from kvgate.router.core.http import HttpRequest
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet
from kvgate.router.gateway import Gateway
from kvgate.router.peers.hints import MAX_HEARD_SENDERS
from kvgate.router.pipeline.bodies import parse_body, read_body
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import format_validation_error

MAX_ADMIN_BODY_BYTES = 65536
"""An admin body is one replica's settings: far less than this."""
MAX_STATE_REPLICAS = 128
"""Replicas ``/admin/state`` lists (``replicas_total`` says how many there are): with the caps below, each takes
about 2 KiB, so the dump stays within a few hundred KiB however large the fleet."""
MAX_STATE_STREAMS = 8
"""Event streams (data-parallel ranks) listed per replica."""
MAX_STATE_MODELS = 8
"""Models (LoRA adapters included) listed per replica."""
MAX_STATE_PEERS = 32
"""Peer gateways listed, the most recently heard first, and peer endpoints and URLs listed."""
MAX_STATE_QUEUES = 32
"""Models and tenants listed with requests waiting at admission, the most waiting first."""


class Admin:
    """The ``/admin`` endpoints (:meth:`add_routes`)."""

    def __init__(self, fleet: Fleet, holder: ConfigHolder, parity: ParityMonitor,
                 state: Callable[[], dict[str, Any]]) -> None:
        self.fleet = fleet
        self.holder = holder
        self.parity = parity
        self.state = state

    def add_routes(self, routes: Routes) -> None:
        routes.add("GET", "/admin/replicas", self.list_replicas)
        routes.add("POST", "/admin/replicas", self.add_replica)
        routes.add("GET", "/admin/state", self.dump_state)
        routes.add("POST", "/admin/replicas/{name}/{action}", self.drain_or_undrain)
        routes.add("DELETE", "/admin/replicas/{name}", self.remove_replica)
        routes.add("POST", "/admin/reload", self.reload_config)

    def authorize(self, request: HttpRequest) -> None:
        """The token in force: the policy file's (reloadable), else the environment's."""
        Credentials.of(self.holder.current.server).require_admin(request.header("authorization"))

    def replica_or_404(self, name: str) -> Replica:
        replica = self.fleet.replicas.get(name)
        if replica is None:
            raise ApiError(404, f"No replica named {name!r}.", param="name", code="replica_not_found")
        return replica

    async def list_replicas(self, request: HttpRequest) -> Response:
        self.authorize(request)
        fleet = self.fleet
        models = self.parity.state()
        data = []
        for replica in fleet.replicas.values():
            status = replica_status(fleet, replica)
            status["parity"] = {m: models[m]["trusted"] for m in status["models"] if m in models}
            data.append(status)
        return json_response({"object": "list", "data": data, "parity": models,
                              "blind": fleet.blindness.state(fleet.clock())})

    async def dump_state(self, request: HttpRequest) -> Response:
        """Everything behind the routing decisions, counted (:func:`state_dump`)."""
        self.authorize(request)
        return json_response(self.state())

    async def add_replica(self, request: HttpRequest) -> Response:
        self.authorize(request)
        raw = await read_body(request, MAX_ADMIN_BODY_BYTES, self.holder.current.server.body_timeout_s, None)
        try:
            cfg = ReplicaConfig.model_validate(parse_body(raw))
        except ValidationError as e:
            raise ApiError(422, format_validation_error(e), code="invalid_value") from e
        try:
            replica = self.fleet.add(cfg)
        except ValueError as e:
            raise ApiError(409, str(e), param="name", code="replica_exists") from e
        return json_response(replica_status(self.fleet, replica), status=201)

    async def drain_or_undrain(self, request: HttpRequest) -> Response:
        """``drain``: no new requests go to the replica; ``undrain``: they may again."""
        self.authorize(request)
        name, action = request.params["name"], request.params["action"]
        if action not in ("drain", "undrain"):
            raise ApiError(404, f"No admin action {action!r}.", code="not_found")
        replica = self.replica_or_404(name)
        (self.fleet.drain if action == "drain" else self.fleet.undrain)(name)
        return json_response(replica_status(self.fleet, replica))

    async def remove_replica(self, request: HttpRequest) -> Response:
        self.authorize(request)
        name = request.params["name"]
        self.replica_or_404(name)
        await self.fleet.remove(name)
        return json_response({"name": name, "deleted": True})

    async def reload_config(self, request: HttpRequest) -> Response:
        self.authorize(request)
        holder = self.holder
        if not holder.reload():
            raise ApiError(400, f"Config rejected, previous config stays in force: {holder.last_error}",
                           code="config_rejected")
        return json_response({"reloaded": True, "reloads_ok": holder.reloads_ok,
                              "reloads_rejected": holder.reloads_rejected})


def replica_status(fleet: Fleet, replica: Replica) -> dict[str, Any]:
    """What an operator wants to see about one replica (also the admin API's response body): its settings and health;
    this gateway's own load there, the peers' reported work (None without work sharing) and the two as the cost
    policy counts them now (``cost_view``, from ``Fleet.view``); the engine's last scrape; and the requests a second
    the engine finished that nobody known sent (``unseen_request_rate_per_s``)."""
    now = fleet.clock()
    scraped = fleet.fresh_scrape(replica, now)
    view = fleet.view(replica.name, PrefixMatch())
    peers = None if fleet.peer_work is None else fleet.peer_work.work(replica.name)
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
        "arrival_rate_per_s": round(view.arrival_rate_per_s, 3),
        "unseen_request_rate_per_s": round(fleet.unseen_rate_per_s(replica, now), 3),
        "peers": None if peers is None else {
            "prefill_tokens": peers.prefill_tokens, "prefilling": peers.prefilling,
            "arrival_rate_per_s": round(peers.arrival_rate_per_s, 3),
        },
        "cost_view": {"in_flight_prefilling": view.in_flight_prefilling,
                      "in_flight_prefill_tokens": view.in_flight_prefill_tokens},
        "scraped": None
        if scraped is None
        else {
            "waiting": scraped.waiting,
            "running": scraped.running,
            "kv_usage": scraped.kv_usage,
            "block_size": scraped.block_size,
            "age_ms": round((now - scraped.at) * 1000.0, 1),
        },
        "models": [m["id"] for m in replica.served_models],
    }


def state_dump(gateway: Gateway) -> dict[str, Any]:
    """``/admin/state``: per replica what the cost policy sees of it (:func:`replica_status`), what the index holds
    there by tier and where its KV-event streams stand; the index's and the event ingestor's totals; the peers; the
    blindness signal; requests waiting at admission. Counts and configuration only, never prompt text, token ids or
    block keys (keys are hashes of prompts); every list is capped (``MAX_STATE_*``), with a count of the whole."""
    fleet = gateway.fleet
    replicas = list(fleet.replicas.values())
    rows = []
    for replica in replicas[:MAX_STATE_REPLICAS]:
        row = replica_status(fleet, replica)
        row["models_total"] = len(row["models"])
        row["models"] = row["models"][:MAX_STATE_MODELS]
        row["index"] = gateway.index.holdings(replica.name)
        row["events"] = gateway.ingestor.stream_state(replica.name, MAX_STATE_STREAMS)
        rows.append(row)
    ingest = gateway.ingestor.stats
    return {
        "replicas_total": len(replicas),
        "replicas_truncated": max(0, len(replicas) - MAX_STATE_REPLICAS),
        "replicas": rows,
        "index": dataclasses.asdict(gateway.index.stats()),
        "events": {
            "events_applied": ingest.events_applied, "frames_applied": ingest.frames_applied,
            "dropped": dict(ingest.dropped), "gaps_detected": ingest.gaps_detected,
            "replays_requested": ingest.replays_requested, "replays_succeeded": ingest.replays_succeeded,
            "replays_failed": ingest.replays_failed, "purges": ingest.purges, "restarts": ingest.restarts,
            "resets": dict(ingest.resets),
        },
        "peers": peers_state(gateway),
        "blind": fleet.blindness.state(fleet.clock()),
        "admission": admission_state(gateway),
    }


def peers_state(gateway: Gateway) -> dict[str, Any]:
    """The other gateways: the ones configured for warm start, the hint endpoints subscribed to (configured and found
    by DNS), each peer heard from with the age of its last message and of its work report in force, and the
    exchange's counters (drops included)."""
    peers = gateway.holder.current.peers
    exchange = gateway.hints.exchange
    reports = dict(exchange.work.report_ages(MAX_HEARD_SENDERS))
    subscribed = exchange.subscribed()
    return {
        "warm_start": {"urls": peers.urls[:MAX_STATE_PEERS], "urls_total": len(peers.urls), "dns": peers.dns.name},
        "hints": {"publishing": bool(peers.hints.bind), "subscribed": subscribed[:MAX_STATE_PEERS],
                  "subscribed_total": len(subscribed), "work_ttl_s": peers.hints.work_ttl_s},
        "heard": [{"instance": sender, "last_message_age_s": round(age, 3),
                   "work_report_age_s": None if sender not in reports else round(reports[sender], 3)}
                  for sender, age in exchange.heard(MAX_STATE_PEERS)],
        "heard_total": exchange.heard_total(),
        "reporting_total": exchange.work.peers(),
        "stats": dataclasses.asdict(exchange.stats),
    }


def admission_state(gateway: Gateway) -> dict[str, Any]:
    """Requests waiting at admission: in all, and for the bands (a request may name its own), models and tenants with
    the most waiting."""
    by_band: dict[int, int] = {}
    by_tenant: dict[str, int] = {}
    for (band, tenant), count in gateway.admission.depth():
        by_band[band] = by_band.get(band, 0) + count
        name = NO_TENANT if tenant is None else tenant
        by_tenant[name] = by_tenant.get(name, 0) + count
    by_model = gateway.admission.depth_by_model()
    return {
        "waiting": sum(by_band.values()),
        "by_band": {str(band): n for band, n in most(by_band)},
        "bands_total": len(by_band),
        "by_model": dict(most(by_model)),
        "models_total": len(by_model),
        "by_tenant": dict(most(by_tenant)),
        "tenants_total": len(by_tenant),
    }


def most(counts: dict[Any, int]) -> list[tuple[Any, int]]:
    """The ``MAX_STATE_QUEUES`` largest counts."""
    return sorted(counts.items(), key=lambda item: -item[1])[:MAX_STATE_QUEUES]
