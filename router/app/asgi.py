"""The gateway's ASGI app: OpenAI-compatible endpoints in front of the fleet, plus kvgate's own endpoints.

``create_app(holder)`` builds the app around a :class:`kvgate.router.gateway.Gateway` (the container of every
component), which the app's lifespan starts on the event loop and stops; once it is built, the endpoint flows are
composed from its components (:class:`Flows`), and each route is one line of :func:`create_app`.

Handlers take the raw ``Request`` and return raw responses (FastAPI's body binding and pydantic validation would cost
more CPU than the whole proxy hop). A body is decoded once with msgspec and forwarded as the very same bytes unless
routing had to add a field (``cache_salt`` for tenants, ``kv_transfer_params`` for transfers), so unknown fields always
pass through.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgate.router.apis.anthropic import COUNT_TOKENS, MESSAGES
from kvgate.router.apis.base import Api
from kvgate.router.apis.openai import CHAT, COMPLETIONS
from kvgate.router.apis.responses import RESPONSES
from kvgate.router.app.admin import build_admin_router, state_dump
from kvgate.router.core.errors import ApiError, install_error_handlers, unexpected_error
from kvgate.router.endpoints.callers import Callers
from kvgate.router.endpoints.count_tokens import CountTokens
from kvgate.router.endpoints.events import EventIngest
from kvgate.router.endpoints.explain import Explain
from kvgate.router.endpoints.generate import Generate
from kvgate.router.endpoints.info import Info
from kvgate.router.endpoints.passthrough import Passthrough
from kvgate.router.endpoints.peer_snapshot import PeerSnapshot
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.endpoints.responses import Responses
from kvgate.router.gateway import Gateway
from kvgate.router.peers.warm_start import INSTANCE_HEADER
from kvgate.router.pipeline.admit import ClientHeaders
from kvgate.router.settings.holder import ConfigHolder

_encode = msgspec.json.Encoder().encode


def json_response(content: object, status: int = 200) -> Response:
    return Response(_encode(content), status_code=status, media_type="application/json")


Handler = Callable[[Request], Awaitable[Response]]


class ProxiedEndpoints:
    """The ASGI app uvicorn serves: the proxied endpoints' POSTs go straight to their handlers, everything else
    (other methods and paths, lifespan) to the FastAPI app it wraps.

    FastAPI's per-request layers — its telemetry check, the error, exception-telemetry and body-limit middlewares,
    route matching, the request wrapper and dependency solving — cost ~7% of kvgate's CPU on a short request in a
    py-spy profile, for handlers that take a raw ``Request`` and need none of it. Errors are answered here as the
    app's handlers answer them (:mod:`kvgate.router.core.errors`): an :class:`ApiError` as itself, anything unexpected
    as a logged 500 in OpenAI's format.
    """

    def __init__(self, app: ASGIApp, handlers: Mapping[str, Handler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except ApiError as e:
            response = e.response()
        except Exception as e:  # noqa: BLE001 - a bug must still get an answer, as the app's 500 handler gives
            response = unexpected_error(e)
        await response(scope, receive, send)


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
                                   g.response_ids, g.stored_responses, g.session, g.spawn)
        self.passthrough = Passthrough(proxied, g.route_stage)
        self.explain = Explain(holder, callers, g.catalog, g.tokenize_stage, g.route_stage, g.index.generation,
                               g.parity, g.queue_stage)
        self.events = EventIngest(holder, callers, g.ingestor)
        self.peer_snapshot = PeerSnapshot(holder, callers, g.fleet, g.ingestor, g.subscriptions, g.warm_start)
        self.info = Info(callers, g.fleet, g.warm_start, g.metrics)


PASSTHROUGH_PATHS = (
    "/v1/embeddings", "/tokenize", "/detokenize", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/pooling", "/classify", "/v1/audio/transcriptions", "/v1/audio/translations",
)
"""Engine endpoints with no prompt prefix worth routing for: sent to the least-loaded replica as they are."""


def create_app(holder: ConfigHolder) -> ProxiedEndpoints:
    """The gateway's ASGI app: :class:`ProxiedEndpoints` in front of the FastAPI app that serves everything else."""
    gateway = Gateway(holder)
    flows: list[Flows] = []
    """The flows, once the lifespan has built the gateway (handlers run only after that)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        flows.append(Flows(gateway))
        app.include_router(build_admin_router(gateway.fleet, holder, gateway.parity, lambda: state_dump(gateway)))
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def generate(api: Api) -> Handler:
        async def endpoint(request: Request) -> Response:
            return await flows[0].generate(request, api)
        return endpoint

    def passthrough(path: str) -> Handler:
        async def endpoint(request: Request) -> Response:
            return await flows[0].passthrough(request, path)
        return endpoint

    async def count_tokens(request: Request) -> Response:
        return await flows[0].count_tokens(request)

    async def create_response(request: Request) -> Response:
        return await flows[0].responses.create(request)

    proxied: dict[str, Handler] = {
        **{api.path: generate(api) for api in (CHAT, COMPLETIONS, MESSAGES)},
        COUNT_TOKENS.path: count_tokens,
        RESPONSES.path: create_response,
        **{path: passthrough(path) for path in PASSTHROUGH_PATHS},
    }
    for path, handler in proxied.items():  # FastAPI's routes answer these paths' other methods (405)
        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await flows[0].responses.by_id(request, response_id, "get")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await flows[0].responses.by_id(request, response_id, "delete")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await flows[0].responses.by_id(request, response_id, "cancel")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return json_response(flows[0].info.models(ClientHeaders.of(request.scope)))

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        return json_response(flows[0].info.ready(ClientHeaders.of(request.scope)))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = flows[0].info.metrics_text(request.headers.get("authorization"))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/kvgate/v1/peer/snapshot")
    async def peer_snapshot(request: Request) -> Response:
        headers = request.headers
        return flows[0].peer_snapshot(headers.get("authorization"), headers.get(INSTANCE_HEADER))

    @app.post("/kvgate/v1/explain")
    async def explain(request: Request) -> Response:
        return json_response(await flows[0].explain(request))

    @app.post("/kvgate/v1/events")
    async def events(request: Request) -> Response:
        return json_response(await flows[0].events(request))

    return ProxiedEndpoints(app, proxied)
