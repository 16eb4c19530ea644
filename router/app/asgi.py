"""The gateway's ASGI app: OpenAI-compatible endpoints in front of the fleet, plus kvgate's own endpoints.

``create_app(holder)`` builds the app around a :class:`kvgate.router.gateway.Gateway` (the composition root), which
the app's lifespan starts on the event loop and stops.

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

from kvgate.router.gateway import Gateway
from kvgate.router.http.admin import build_admin_router
from kvgate.router.http.errors import ApiError, install_error_handlers, unexpected_error
from kvgate.router.ops.reload import ConfigHolder
from kvgate.router.peers.warm_start import INSTANCE_HEADER
from kvgate.router.pipeline.admit import ClientHeaders

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
    app's handlers answer them (:mod:`router.http.errors`): an :class:`ApiError` as itself, anything unexpected as a
    logged 500 in OpenAI's format.
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


def create_app(holder: ConfigHolder) -> ProxiedEndpoints:
    """The gateway's ASGI app: :class:`ProxiedEndpoints` in front of the FastAPI app that serves everything else
    (``.app``; its ``state.gateway`` is the :class:`Gateway`)."""
    gateway = Gateway(holder)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        app.include_router(build_admin_router(gateway.fleet, holder))
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    install_error_handlers(app)

    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, "chat", "/v1/chat/completions")

    async def completions(request: Request) -> Response:
        return await gateway.generate(request, "completions", "/v1/completions")

    async def embeddings(request: Request) -> Response:
        return await gateway.passthrough(request, "/v1/embeddings")

    proxied: dict[str, Handler] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/embeddings": embeddings,
    }
    for path, handler in proxied.items():  # FastAPI's routes answer these paths' other methods (405)
        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return json_response({"object": "list", "data": gateway.models_for(ClientHeaders.of(request.scope))})

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Open to probes: ready while a replica passes its health checks (open circuits are transient ejections,
        and a client's failures must not unready the gateway); the routable replicas' names only to callers who may
        send requests."""
        if gateway.warming:
            raise ApiError(503, "warming up from a peer's index snapshot", code="warming")
        serving = gateway.fleet.serving()
        if not serving:
            raise ApiError(503, "no replica passes its health checks", code="no_replica")
        if not gateway.may_call(ClientHeaders.of(request.scope)):
            return json_response({"status": "ready"})
        return json_response({"status": "ready", "routable": [r.name for r in serving if r.routable()]})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway.credentials.require_metrics(request.headers.get("authorization"))
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kvgate/v1/peer/snapshot")
    async def peer_snapshot(request: Request) -> Response:
        headers = request.headers
        return gateway.peer_snapshot(headers.get("authorization"), headers.get(INSTANCE_HEADER))

    @app.post("/kvgate/v1/explain")
    async def explain(request: Request) -> Response:
        return json_response(await gateway.explain(request))

    @app.post("/kvgate/v1/events")
    async def events(request: Request) -> Response:
        return json_response(await gateway.ingest_events(request))

    return ProxiedEndpoints(app, proxied)
