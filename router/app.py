"""The gateway's FastAPI app: OpenAI-compatible endpoints in front of the fleet, plus kvgate's own endpoints.

``create_app(holder)`` builds the app around a :class:`Gateway`, whose ``start()`` (run by the app's lifespan, on the
event loop) creates everything that needs a running loop: the one upstream aiohttp session, the fleet's health and
scrape loops, KV-event subscriptions and config watching. ``stop()`` tears them down in reverse.

Handlers take the raw ``Request`` and return raw responses (FastAPI's body binding and pydantic validation would cost
more CPU than the whole proxy hop). A body is decoded once with msgspec and forwarded as the very same bytes unless
routing had to add a field (``cache_salt`` for tenants, ``kv_transfer_params`` for transfers), so unknown fields always
pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_index.http_ingest import HttpIngestError, ingest_http
from cache_index.index import PrefixIndex
from cache_index.ingest import EventIngestor
from cache_index.subscriber import SubscriptionManager
from policies.base import NoHealthyReplica
from policies.config import ConfigError, KvgateConfig
from router.admin import build_admin_router
from router.bodies import client_salt, parse_body, read_body, required_model, wants_stream
from router.errors import ApiError, install_error_handlers, unexpected_error
from router.fleet import Fleet, FleetListener, Replica
from router.logs import RequestLogger
from router.metrics import (
    CONFIG_SERIES,
    INDEX_SERIES,
    INGEST_SERIES,
    PREFILL_SERIES,
    REPLICATION_SERIES,
    TOKENIZER_SERIES,
    GatewayMetrics,
    ReplicaStateCollector,
    prefill_avoided_ms,
)
from router.prompts import PromptError, PromptTokenizer
from router.proxy import (
    AttemptFailed,
    Forward,
    Proxy,
    RelayResponse,
    StreamResult,
    Upstream,
    Usage,
    cancel_on_disconnect,
    create_session,
    left_early,
    relay_stream,
    usage_of_body,
)
from router.reload import ConfigHolder
from router.routing import Endpoint, FleetDispatcher, Routed, Router
from router.tenants import AuthError, TenantResolver, cache_salt_for
from router.transfers import TransferRunner
from router.warmups import WarmupRunner

log = logging.getLogger("kvgate.app")

CALIBRATION_REFRESH_S = 1.0
"""How often calibrated prefill coefficients are refitted and swapped in."""
CLIENT_CLOSED = "499"
"""Status recorded for requests whose client left before any answer (nginx's convention)."""

_encode = msgspec.json.Encoder().encode
_REQUEST_ID_PREFIX = secrets.token_hex(10)
_request_numbers = itertools.count()


def new_request_id() -> str:
    """An id for a request that came without ``X-Request-Id``: a random per-process prefix and a counter, 32 hex
    characters like a UUID's and as unique across gateway replicas, without ``uuid4``'s system call per request."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_numbers):012x}"


def json_response(content: object, status: int = 200) -> Response:
    return Response(_encode(content), status_code=status, media_type="application/json")


_CLIENT_HEADERS = frozenset((b"x-request-id", b"x-session-id", b"authorization"))


@dataclass(slots=True)
class ClientHeaders:
    """The client headers the gateway acts on, read in one pass over the ASGI headers (first value of each, as
    Starlette's ``Headers.get``, which scans the whole list and raises and catches a KeyError for each one absent)."""

    request_id: str | None = None
    session_id: str | None = None
    authorization: str | None = None

    @classmethod
    def of(cls, scope: Scope) -> ClientHeaders:
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in _CLIENT_HEADERS and name not in found:
                found[name] = value.decode("latin-1")
        return cls(found.get(b"x-request-id"), found.get(b"x-session-id"), found.get(b"authorization"))


class IndexFeed(FleetListener):
    """Keeps the prefix index's replicas (ingestor + event subscriptions) in step with the fleet's membership."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def on_added(self, replica: Replica) -> None:
        self.gateway.track_replica(replica)

    def on_removed(self, name: str) -> None:
        self.gateway.untrack_replica(name)

    def on_reset(self, name: str, reason: str) -> None:
        self.gateway.ingestor.reset_replica(name, reason)


class Gateway:
    """Everything one running gateway owns, and the request handlers that use it."""

    def __init__(self, holder: ConfigHolder) -> None:
        self.holder = holder
        self.metrics = GatewayMetrics()
        self.request_log = RequestLogger(holder.current.server.log_requests)
        self._background: set[asyncio.Task[None]] = set()

    @property
    def config(self) -> KvgateConfig:
        return self.holder.current

    # lifecycle

    async def start(self) -> None:
        config = self.config
        self.session = create_session(config.proxy)
        self.proxy = Proxy(self.session, config.proxy, on_retry=self._count_retry)
        self.fleet = Fleet(config, self.session)
        self.index = PrefixIndex(config.index.max_entries, config.index.predicted_ttl_s)
        self.ingestor = EventIngestor(self.index)
        self.subscriptions = SubscriptionManager(self.ingestor, replay_timeout_s=config.index.replay_timeout_s)
        self.tokenizer = PromptTokenizer(config.models, engine_tokenize=self._engine_tokenize)
        self.tenants = TenantResolver(config.tenants)
        self.router = Router(config, self.fleet, self.index, self.tokenizer)
        self.fleet.listeners.append(IndexFeed(self))
        self._register_collectors()
        self.holder.subscribe(self.apply_config)
        await self.fleet.start()
        await self.holder.start()
        self.transfers = TransferRunner(self.proxy, self.metrics, self.holder)
        self.warmups = WarmupRunner(self.router, self.fleet, self.proxy, self.transfers, self.metrics, self._spawn)
        self._spawn(self._calibration_loop())
        self._spawn(self.warmups.run())

    async def stop(self) -> None:
        await self.holder.stop()
        await self.fleet.stop()
        await self.subscriptions.stop_all()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self.tokenizer.close()
        await self.session.close()

    def apply_config(self, config: KvgateConfig) -> None:
        """A reloaded policy file; requests in flight keep the objects they started with."""
        self.fleet.apply_config(config)
        self.router.apply_config(config)
        self.tenants = TenantResolver(config.tenants)
        if config.models != self.router.tokenizer_models:
            self._replace_tokenizer(config)
        self.proxy.config = config.proxy
        self.request_log.enabled = config.server.log_requests

    def _replace_tokenizer(self, config: KvgateConfig) -> None:
        """New model tokenizers take effect for new requests; a path that does not load keeps the old ones."""
        try:
            tokenizer = PromptTokenizer(config.models, engine_tokenize=self._engine_tokenize)
        except ConfigError as e:
            log.error("reload: keeping the previous tokenizers: %s", e)
            return
        old, self.tokenizer = self.tokenizer, tokenizer
        self.router.tokenizer = tokenizer
        self.router.tokenizer_models = config.models
        old.close()

    def track_replica(self, replica: Replica) -> None:
        """Index this replica's KV events under its model's namespace (label ``model``, else the file's first model)."""
        cfg = replica.config
        model_name = cfg.labels.get("model") or (self.config.models[0].name if self.config.models else "")
        model = self.config.model(model_name)
        self.ingestor.add_replica(
            cfg.name,
            model=model_name,
            weight_version=model.weight_version if model else "",
            block_size=model.block_size if model else None,
        )
        if cfg.kv_events:
            self.subscriptions.start(cfg.name, cfg.kv_events, cfg.kv_replay, cfg.kv_topic)

    def untrack_replica(self, name: str) -> None:
        self.ingestor.remove_replica(name)
        self._spawn(self.subscriptions.stop(name))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _calibration_loop(self) -> None:
        while True:
            await asyncio.sleep(CALIBRATION_REFRESH_S)
            self.router.refresh_calibration()

    def _register_collectors(self) -> None:
        m = self.metrics
        m.add_collector(ReplicaStateCollector(lambda: list(self.fleet.replicas.values())))
        m.add_stats(self.index.stats, INDEX_SERIES)
        m.add_stats(lambda: self.ingestor.stats, INGEST_SERIES)
        m.add_stats(lambda: self.tokenizer.stats, TOKENIZER_SERIES)
        m.add_stats(lambda: self.holder, CONFIG_SERIES)
        m.add_stats(self.router.coefficients, PREFILL_SERIES)
        m.add_stats(self.router.replication_counts, REPLICATION_SERIES)

    def _count_retry(self, cause: str) -> None:
        self.metrics.retries.labels(cause).inc()

    async def _engine_tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize`` on a routable replica: the tokenizer's fallback for models with no local tokenizer."""
        replicas = self.fleet.routable()
        if not replicas:
            raise NoHealthyReplica("no routable replica to tokenize on")
        timeout = aiohttp.ClientTimeout(total=self.config.proxy.first_byte_timeout_s)
        async with self.session.post(replicas[0].url + "/tokenize", json=payload, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json()

    # request handling

    def _tenant(self, client: ClientHeaders) -> str | None:
        try:
            return self.tenants.resolve(client.authorization)
        except AuthError as e:
            raise ApiError(401, e.message, code=e.code) from e

    def _upstream_headers(self, client: ClientHeaders, request_id: str) -> dict[str, str]:
        out = {"content-type": "application/json", "x-request-id": request_id}
        session_id = client.session_id
        if session_id:
            out["x-session-id"] = session_id
        authorization = client.authorization
        if authorization and not self.tenants.enabled:
            out["authorization"] = authorization  # the engine's own key; with tenants on, the key is kvgate's
        return out

    async def _read_request(self, request: Request) -> tuple[bytes, dict[str, Any], str]:
        """The body as received and decoded, and its model: a body over ``server.max_body_bytes``, not a JSON object,
        without a model, or naming a model no replica serves is an :class:`ApiError`."""
        raw = await read_body(request, self.config.server.max_body_bytes)
        body = parse_body(raw)
        model = required_model(body)
        self._check_model(model)
        return raw, body, model

    def _check_model(self, model: str) -> None:
        if self.router.knows_model(model):
            return
        if not self.fleet.routable():
            raise ApiError(503, "no routable replica", code="no_replica")
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def generate(self, request: Request, endpoint: Endpoint, path: str) -> Response:
        """Completions and chat completions: route on the prompt's cached prefix, proxy, stream back."""
        started = time.monotonic()
        client = ClientHeaders.of(request.scope)
        request_id = client.request_id or new_request_id()
        tenant: str | None = None
        try:
            tenant = self._tenant(client)
            raw, body, model = await self._read_request(request)
            stream = wants_stream(body)
            salt = client_salt(body)
            upstream_salt = cache_salt_for(tenant, salt)
            if upstream_salt != salt:
                body["cache_salt"] = upstream_salt
                raw = _encode(body)
            try:
                routed = await self.router.route(
                    endpoint, body, model=model, request_id=request_id, session_id=client.session_id,
                    tenant=tenant, cache_salt=upstream_salt,
                )
            except PromptError as e:
                raise ApiError(400, e.message, param=e.param, code="invalid_prompt") from e
            except NoHealthyReplica as e:
                raise ApiError(503, "no replica can serve this model", code="no_replica") from e
        except ApiError as e:
            self._rejected(e, request_id, tenant, started)
            raise
        decision = routed.decision
        self.metrics.decisions.labels(decision.action, decision.reason).inc()
        self.metrics.route_seconds.observe(routed.route_ms / 1000.0)
        self.metrics.lookup_seconds.observe(routed.lookup_ms / 1000.0)
        dispatcher = FleetDispatcher(self.fleet, routed.prefill_tokens)
        up_headers = self._upstream_headers(client, request_id)
        transferred = False
        if decision.action == "transfer" and decision.source:
            raw, transferred = await self.transfers.pull(path, body, raw, up_headers, routed, dispatcher)
        self.router.dispatched(routed, decision.replica)
        fwd = Forward(path, raw, up_headers, stream, decision.ranked or [decision.replica],
                      self.config.proxy.max_attempts)
        try:
            up = await self._forward_while_connected(request, fwd, dispatcher)
        except AttemptFailed as failed:
            if transferred:
                self.transfers.finished_for(routed, ok=False)
            return self._failed(failed, routed, request_id, started)
        if up is None:
            return self._client_left(routed, request_id, started)
        if transferred:
            self.transfers.finished_for(routed, ok=up.status == 200)
        if up.replica != decision.replica:
            self.router.dispatched(routed, up.replica)
        out_headers = up.client_headers()
        out_headers.update({
            "x-request-id": request_id, "x-kvgate-replica": up.replica, "x-kvgate-decision": decision.reason,
        })
        if stream and up.status == 200:
            def on_end(result: StreamResult) -> None:
                up.ticket.finish(result.end != "stream_error")
                self._completed(routed, up, started, result.finished_at, result.usage, result.end, stream=True)

            return RelayResponse(relay_stream(up, on_end), status_code=up.status, headers=out_headers)
        up.ticket.finish(True)
        usage = usage_of_body(up.body) if up.status == 200 else None
        self._completed(routed, up, started, up.first_byte_at, usage, "ok", stream=False)
        return Response(up.body, status_code=up.status, headers=out_headers)

    async def _forward_while_connected(
        self, request: Request, fwd: Forward, dispatcher: FleetDispatcher
    ) -> Upstream | None:
        """``proxy.forward``, cancelled the moment the client disconnects (None then): closing the upstream
        connection makes the engine abort the sequence, even during a long prefill before any byte came back.

        The forward runs in the request's own task and only the watcher is a second one, which cancels this task
        when the client leaves: a task for the forward plus ``asyncio.wait`` cost more CPU per request."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(cancel_on_disconnect(request.receive, task))
        try:
            return await self.proxy.forward(fwd, dispatcher)
        except asyncio.CancelledError:
            if left_early(watcher):
                task.uncancel()
                return None
            raise
        finally:
            watcher.cancel()

    async def passthrough(self, request: Request, path: str) -> Response:
        """Requests with no prompt prefix to match (embeddings): least-loaded replica, body unchanged."""
        started = time.monotonic()
        client = ClientHeaders.of(request.scope)
        request_id = client.request_id or new_request_id()
        tenant: str | None = None
        try:
            tenant = self._tenant(client)
            raw, _, model = await self._read_request(request)
            try:
                decision = self.router.route_passthrough(model)
            except NoHealthyReplica as e:
                raise ApiError(503, "no replica can serve this model", code="no_replica") from e
        except ApiError as e:
            self._rejected(e, request_id, tenant, started)
            raise
        dispatcher = FleetDispatcher(self.fleet, lambda _: 0)
        fwd = Forward(path, raw, self._upstream_headers(client, request_id), False, decision.ranked,
                      self.config.proxy.max_attempts)
        try:
            up = await self.proxy.forward(fwd, dispatcher)
        except AttemptFailed as failed:
            err = failed.to_api_error()
            self.metrics.requests.labels("", str(failed.status or err.status), decision.reason).inc()
            return err.response({"x-request-id": request_id})
        up.ticket.finish(True)
        self.metrics.requests.labels(up.replica, str(up.status), decision.reason).inc()
        out_headers = up.client_headers()
        out_headers.update({"x-request-id": request_id, "x-kvgate-replica": up.replica,
                            "x-kvgate-decision": decision.reason})
        return Response(up.body, status_code=up.status, headers=out_headers)

    async def explain(self, request: Request) -> dict[str, Any]:
        """Route a completions or chat body without sending it; the decision and the numbers behind it."""
        client = ClientHeaders.of(request.scope)
        tenant = self._tenant(client)
        _, body, model = await self._read_request(request)
        endpoint: Endpoint = "chat" if "messages" in body else "completions"
        salt = cache_salt_for(tenant, client_salt(body))
        try:
            routed = await self.router.route(
                endpoint, body, model=model, request_id=client.request_id or new_request_id(),
                session_id=client.session_id, tenant=tenant, cache_salt=salt, explain=True,
            )
        except PromptError as e:
            raise ApiError(400, e.message, param=e.param, code="invalid_prompt") from e
        except NoHealthyReplica as e:
            raise ApiError(503, "no replica can serve this model", code="no_replica") from e
        return self.router.explain(routed)

    async def ingest_events(self, request: Request) -> dict[str, Any]:
        """KV events over HTTP, for engines that cannot reach kvgate over ZMQ (same sequence rules)."""
        raw = await read_body(request, self.config.server.max_body_bytes)
        headers = request.headers
        try:
            result = ingest_http(
                self.ingestor, headers.get("x-kvgate-replica"), raw, headers.get("content-type"),
                seq=_int_header(headers, "x-kvgate-seq"), dp_rank=_int_header(headers, "x-kvgate-dp-rank"),
            )
        except HttpIngestError as e:
            raise ApiError(400, str(e), code="invalid_events") from e
        return {"status": result.status.name.lower(), "events": result.events}

    # accounting

    def _rejected(self, err: ApiError, request_id: str, tenant: str | None, started: float) -> None:
        self.metrics.rejections.labels(err.code or str(err.status)).inc()
        self.request_log.request(
            id=request_id, tenant=tenant, replica=None, decision=None, status=err.status, error=err.code,
            e2e_ms=round((time.monotonic() - started) * 1000.0, 3), attempts=0,
        )

    def _failed(self, failed: AttemptFailed, routed: Routed, request_id: str, started: float) -> Response:
        """Every attempt failed before any byte reached the client: the last engine error as is, else 502/504."""
        headers = {"x-request-id": request_id, "x-kvgate-decision": routed.decision.reason}
        if failed.status is not None:
            status = failed.status
            response = Response(failed.body, status_code=status, headers=headers,
                                media_type=failed.headers.get("Content-Type", "application/json"))
        else:
            err = failed.to_api_error()
            status = err.status
            response = err.response(headers)
        self.metrics.requests.labels("", str(status), routed.decision.reason).inc()
        self.request_log.request(
            id=request_id, tenant=routed.request.tenant, replica=None, decision=routed.decision.reason,
            action=routed.decision.action, prompt_tokens=routed.request.prompt_tokens, status=status,
            error=failed.cause, e2e_ms=round((time.monotonic() - started) * 1000.0, 3),
            attempts=self.config.proxy.max_attempts,
        )
        return response

    def _client_left(self, routed: Routed, request_id: str, started: float) -> Response:
        self.metrics.client_disconnects.inc()
        self.metrics.requests.labels("", CLIENT_CLOSED, routed.decision.reason).inc()
        self.request_log.request(
            id=request_id, tenant=routed.request.tenant, replica=None, decision=routed.decision.reason,
            action=routed.decision.action, prompt_tokens=routed.request.prompt_tokens, status=CLIENT_CLOSED,
            e2e_ms=round((time.monotonic() - started) * 1000.0, 3),
        )
        return Response(status_code=int(CLIENT_CLOSED))

    def _completed(
        self, routed: Routed, up: Upstream, started: float, finished_at: float, usage: Usage | None, end: str,
        *, stream: bool,
    ) -> None:
        request = routed.request
        matched = routed.matched_tokens(up.replica)
        cached = usage.cached_tokens if usage is not None and usage.cached_tokens is not None else None
        hit = "hit" if (cached if cached is not None else matched) > 0 else "miss"
        ttft_ms = (up.first_byte_at - started) * 1000.0
        e2e_ms = (finished_at - started) * 1000.0
        status = str(up.status) if end == "ok" else end
        m = self.metrics
        m.requests.labels(up.replica, status, routed.decision.reason).inc()
        m.e2e.labels(hit).observe(e2e_ms / 1000.0)
        m.matched_tokens.observe(matched)
        if end == "ok" and up.status == 200:
            avoided_ms = prefill_avoided_ms(
                routed.routing.cost_model, request.prompt_tokens, matched if cached is None else cached
            )
            m.prefill_avoided.inc(avoided_ms / 1000.0)
        if end == "stream_error":
            m.stream_errors.inc()
        elif end == "client_disconnect":
            m.client_disconnects.inc()
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(cached or 0)
        if stream:
            m.ttft.labels(hit).observe(ttft_ms / 1000.0)
            if end == "ok" and up.status == 200:
                self._calibrate(routed, up.replica, ttft_ms, usage)
        self.request_log.request(
            id=request.request_id, tenant=request.tenant, model=request.model, replica=up.replica,
            decision=routed.decision.reason, action=routed.decision.action, prompt_tokens=request.prompt_tokens,
            matched_tokens=matched, cached_tokens=cached, ttft_ms=round(ttft_ms, 3) if stream else None,
            e2e_ms=round(e2e_ms, 3), status=status, attempts=up.attempts, stream=stream,
        )

    def _calibrate(self, routed: Routed, replica: str, ttft_ms: float, usage: Usage | None) -> None:
        """Feed the calibrator the engine's own token counts, or the router's when they are exact."""
        if usage is not None and usage.cached_tokens is not None:
            self.router.observe(routed, replica, ttft_ms, usage.prompt_tokens, usage.cached_tokens)
        elif not routed.request.approximate:
            request = routed.request
            self.router.observe(routed, replica, ttft_ms, request.prompt_tokens, routed.matched_tokens(replica))


def _int_header(headers: Headers, name: str) -> int | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"header {name} must be an integer", param=name, code="invalid_header") from None


Handler = Callable[[Request], Awaitable[Response]]


class ProxiedEndpoints:
    """The ASGI app uvicorn serves: the proxied endpoints' POSTs go straight to their handlers, everything else
    (other methods and paths, lifespan) to the FastAPI app it wraps.

    FastAPI's per-request layers — its telemetry check, the error, exception-telemetry and body-limit middlewares,
    route matching, the request wrapper and dependency solving — cost ~7% of kvgate's CPU on a short request in a
    py-spy profile, for handlers that take a raw ``Request`` and need none of it. Errors are answered here as the
    app's handlers answer them (:mod:`router.errors`): an :class:`ApiError` as itself, anything unexpected as a
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
    async def models() -> Response:
        return json_response({"object": "list", "data": gateway.fleet.models()})

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        routable = [r.name for r in gateway.fleet.routable()]
        if not routable:
            raise ApiError(503, "no routable replica", code="no_replica")
        return json_response({"status": "ready", "routable": routable})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/kvgate/v1/explain")
    async def explain(request: Request) -> Response:
        return json_response(await gateway.explain(request))

    @app.post("/kvgate/v1/events")
    async def events(request: Request) -> Response:
        return json_response(await gateway.ingest_events(request))

    return ProxiedEndpoints(app, proxied)
