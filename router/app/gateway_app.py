"""The gateway as the server serves it: its components (:class:`kvgate.router.gateway.Gateway`), the endpoint flows
composed from them (:class:`Flows`), and every route, one line each (:func:`create_app`).

Endpoints take kvgate's own :class:`~kvgate.router.core.http.HttpRequest` and answer with a Starlette ``Response`` or
a :class:`~kvgate.router.core.http.StreamedAnswer`. A body is decoded once with msgspec and forwarded as the very same
bytes unless routing had to add a field (``cache_salt`` for tenants, ``kv_transfer_params`` for transfers), so
unknown fields always pass through.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from kvgate.router.apis.anthropic import COUNT_TOKENS, MESSAGES
from kvgate.router.apis.base import Api
from kvgate.router.apis.openai import CHAT, COMPLETIONS
from kvgate.router.apis.responses import RESPONSES
from kvgate.router.app.admin import Admin, state_dump
from kvgate.router.app.routes import Endpoint, Routes
from kvgate.router.core.errors import json_response
from kvgate.router.core.http import HttpRequest
from kvgate.router.endpoints.callers import Callers
from kvgate.router.endpoints.count_tokens import CountTokens
from kvgate.router.endpoints.events import EventIngest
from kvgate.router.endpoints.explain import Explain
from kvgate.router.endpoints.generate import Generate
from kvgate.router.endpoints.info import Info
from kvgate.router.endpoints.passthrough import Passthrough
from kvgate.router.endpoints.peer_snapshot import PeerSnapshot
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.endpoints.responses import Action, Responses
from kvgate.router.gateway import Gateway
from kvgate.router.peers.warm_start import INSTANCE_HEADER
from kvgate.router.pipeline.admit import ClientHeaders
from kvgate.router.settings.holder import ConfigHolder

PASSTHROUGH_PATHS = (
    "/v1/embeddings", "/tokenize", "/detokenize", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/pooling", "/classify", "/v1/audio/transcriptions", "/v1/audio/translations",
)
"""Engine endpoints with no prompt prefix worth routing for: sent to the least-loaded replica as they are."""


class Flows:
    """The endpoint flows, composed from the gateway's components once it is built."""

    def __init__(self, gateway: Gateway) -> None:
        g = gateway
        holder = g.holder
        callers = Callers(g.tenants, holder)
        proxied = ProxiedRequests(holder, g.tenants, callers, g.catalog, g.forwarder, g.accounting, g.tracer)
        self.generate = Generate(proxied, g.tokenize_stage, g.queue_stage, g.route_stage)
        self.count_tokens = CountTokens(proxied, g.tokenize_stage, g.route_stage)
        self.responses = Responses(holder, proxied, g.tokenize_stage, g.queue_stage, g.route_stage, g.fleet,
                                   g.response_ids, g.stored_responses, g.engines, g.spawn)
        self.passthrough = Passthrough(proxied, g.route_stage)
        self.explain = Explain(holder, callers, g.catalog, g.tokenize_stage, g.route_stage, g.index.generation,
                               g.parity, g.queue_stage)
        self.events = EventIngest(holder, callers, g.ingestor)
        self.peer_snapshot = PeerSnapshot(holder, callers, g.fleet, g.ingestor, g.subscriptions, g.warm_start)
        self.info = Info(callers, g.fleet, g.warm_start, g.metrics)
        self.admin = Admin(g.fleet, holder, g.parity, lambda: state_dump(g))


class GatewayApp:
    """The gateway and its routes: :meth:`start` builds and starts the gateway, then adds the routes (the server
    listens only after that), :meth:`stop` stops it."""

    def __init__(self, holder: ConfigHolder) -> None:
        self.gateway = Gateway(holder)
        self.routes = Routes()

    async def start(self) -> None:
        await self.gateway.start()
        add_routes(self.routes, Flows(self.gateway))

    async def stop(self) -> None:
        await self.gateway.stop()


def add_routes(routes: Routes, flows: Flows) -> None:
    """Every route of the gateway, one line each."""

    def generate(api: Api) -> Endpoint:
        async def endpoint(request: HttpRequest) -> object:
            return await flows.generate(request, api)
        return endpoint

    def passthrough(path: str) -> Endpoint:
        async def endpoint(request: HttpRequest) -> object:
            return await flows.passthrough(request, path)
        return endpoint

    def response_by_id(action: Action) -> Endpoint:
        async def endpoint(request: HttpRequest) -> object:
            return await flows.responses.by_id(request, request.params["response_id"], action)
        return endpoint

    async def models(request: HttpRequest) -> Response:
        return json_response(flows.info.models(ClientHeaders.of(request.headers)))

    async def health(request: HttpRequest) -> Response:
        return json_response({"status": "ok"})

    async def ready(request: HttpRequest) -> Response:
        return json_response(flows.info.ready(ClientHeaders.of(request.headers)))

    async def metrics(request: HttpRequest) -> Response:
        return Response(flows.info.metrics_text(request.header("authorization")), media_type=CONTENT_TYPE_LATEST)

    async def peer_snapshot(request: HttpRequest) -> Response:
        return flows.peer_snapshot(request.header("authorization"), request.header(INSTANCE_HEADER))

    async def explain(request: HttpRequest) -> Response:
        return json_response(await flows.explain(request))

    async def events(request: HttpRequest) -> Response:
        return json_response(await flows.events(request))

    for api in (CHAT, COMPLETIONS, MESSAGES):
        routes.add("POST", api.path, generate(api))
    routes.add("POST", COUNT_TOKENS.path, flows.count_tokens)
    routes.add("POST", RESPONSES.path, flows.responses.create)
    for path in PASSTHROUGH_PATHS:
        routes.add("POST", path, passthrough(path))
    routes.add("GET", "/v1/responses/{response_id}", response_by_id("get"))
    routes.add("DELETE", "/v1/responses/{response_id}", response_by_id("delete"))
    routes.add("POST", "/v1/responses/{response_id}/cancel", response_by_id("cancel"))
    routes.add("GET", "/v1/models", models)
    routes.add("GET", "/health", health)
    routes.add("GET", "/ready", ready)
    routes.add("GET", "/metrics", metrics)
    routes.add("GET", "/kvgate/v1/peer/snapshot", peer_snapshot)
    routes.add("POST", "/kvgate/v1/explain", explain)
    routes.add("POST", "/kvgate/v1/events", events)
    flows.admin.add_routes(routes)
