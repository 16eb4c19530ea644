"""The gateway: its composition root and the request paths of its endpoints.

:class:`Gateway` builds every component of one running gateway in one place (:meth:`Gateway.build`: the upstream
session and proxy, the fleet and discovery, the prefix index with its ingestor and event subscriptions, the prompt
tokenizer, tenants, the router, transfers, replication, and the request path's forwarder and accounting), starts and
stops them, and applies reloaded policy files. Its endpoint methods compose the stages of :mod:`kvgate.router.pipeline`;
:mod:`kvgate.router.http.app` serves them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import zmq
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from kvgate.cache_index.http_ingest import HttpIngestError, apply_http_frame, decode_http_frame
from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.policies.base import NoHealthyReplica
from kvgate.router.config import ConfigError, KvgateConfig
from kvgate.router.fleet.block_sizes import BlockSizes
from kvgate.router.fleet.discovery import Discovery
from kvgate.router.fleet.state import Fleet, FleetListener, Replica
from kvgate.router.http.auth import Credentials, peer_token
from kvgate.router.http.bodies import read_body
from kvgate.router.http.errors import ApiError
from kvgate.router.http.explain import explain_body, tenant_view
from kvgate.router.http.tenants import TenantResolver
from kvgate.router.ops.logs import RequestLogger
from kvgate.router.ops.metrics import (
    BLOCK_SIZE_SERIES,
    CONFIG_SERIES,
    HINT_SERIES,
    INDEX_SERIES,
    INGEST_SERIES,
    PREFILL_SERIES,
    REPLICATION_SERIES,
    TOKENIZER_SERIES,
    GatewayMetrics,
    ReplicaStateCollector,
)
from kvgate.router.ops.reload import ConfigHolder
from kvgate.router.peers.hints import HintExchange
from kvgate.router.peers.snapshot import CONTENT_TYPE as SNAPSHOT_CONTENT_TYPE
from kvgate.router.peers.snapshot import Applied, Snapshot, SnapshotRejected, apply_snapshot, take_snapshot
from kvgate.router.peers.warm_start import take_from_peers
from kvgate.router.pipeline.account import Accounting
from kvgate.router.pipeline.admit import (
    Admission, ClientHeaders, check_client_ids, read_within_limits, resolve_tenant, upstream_headers,
)
from kvgate.router.pipeline.forward import Forwarder, relay
from kvgate.router.pipeline.parse import parse, salt_for_tenant
from kvgate.router.pipeline.route import route, routing_errors, tokenize
from kvgate.router.prompts.tokenizer import PromptTokenizer
from kvgate.router.routing.replication import Replication
from kvgate.router.routing.router import Endpoint, FleetDispatcher, Router
from kvgate.router.routing.handoff import Handoffs
from kvgate.router.routing.handoff.sglang import SglangHandoff
from kvgate.router.routing.handoff.vllm import VllmHandoff
from kvgate.router.routing.transfers import TransferRunner
from kvgate.router.upstream.proxy import AttemptFailed, Forward, Proxy, StreamResult, Upstream, create_session

log = logging.getLogger("kvgate.app")

CALIBRATION_REFRESH_S = 1.0
"""How often calibrated prefill coefficients are refitted and swapped in."""


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

    def on_recovered(self, name: str, started_at: float | None) -> None:
        self.gateway.ingestor.engine_recovered(name, started_at)

    def on_restarted(self, name: str, started_at: float) -> None:
        self.gateway.ingestor.engine_started(name, started_at)


def hint_settings(config: KvgateConfig) -> tuple[object, ...]:
    """What the hint exchange is built from: a reload that changes any of it rebinds the exchange."""
    return config.peers.hints, config.peers.dns, peer_token(config.server)


class Gateway:
    """The composition root: everything one running gateway owns, built in :meth:`build`, started and stopped here,
    and the endpoints' request paths composed from the stages of :mod:`kvgate.router.pipeline`."""

    def __init__(self, holder: ConfigHolder) -> None:
        self.holder = holder
        self.metrics = GatewayMetrics()
        self.request_log = RequestLogger(holder.current.server.log_requests)
        self._background: set[asyncio.Task[None]] = set()
        self.instance = secrets.token_hex(8)
        """Tells this process apart from its peers (it never takes its own snapshot)."""
        peers = holder.current.peers
        self.warming = peers.enabled and peers.warm_start_timeout_s > 0
        """Taking the prefix index from a peer: not ready, and event subscriptions wait (``_warm_start``)."""
        self._unsubscribed: set[str] = set()

    @property
    def config(self) -> KvgateConfig:
        return self.holder.current

    # lifecycle

    def build(self) -> None:
        """Every component, in dependency order, from the policy file in force. Run on the event loop (the upstream
        session binds to it), by :meth:`start`."""
        config = self.config
        self.session = create_session(config.proxy)
        self.proxy = Proxy(self.session, config.proxy, on_retry=self._count_retry,
                           on_failure=self._count_upstream_failure)
        self.fleet = Fleet(config, self.session)
        self.discovery = Discovery(config, self.fleet)
        self.index = PrefixIndex(config.index.max_entries, config.index.predicted_ttl_s)
        self.ingestor = EventIngestor(self.index)
        self.subscriptions = SubscriptionManager(self.ingestor, replay_timeout_s=config.index.replay_timeout_s)
        self.tokenizer = PromptTokenizer(config.models, engine_tokenize=self._engine_tokenize, limits=config.limits)
        self.tenants = TenantResolver(config.tenants)
        self.block_sizes = BlockSizes(self.ingestor.block_size, self._scraped_block_size)
        self.router = Router(config, self.fleet, self.index, self.tokenizer, block_sizes=self.block_sizes)
        self.hints = self._hint_exchange(config)
        self._hints_settings = hint_settings(config)
        self._hints_rebinding = asyncio.Lock()
        self.transfers = TransferRunner(self.proxy, self.metrics, self.holder)
        self.replication = Replication(self.router, self.fleet, self.index, self.proxy, self.transfers, self.metrics,
                                       self._spawn)
        self._wire_hints(config)
        self.handoffs = Handoffs({"vllm": VllmHandoff(self.transfers),
                                  "sglang": SglangHandoff(self.proxy, self.transfers, self.holder)})
        self.forwarder = Forwarder(self.proxy, self.fleet, self.router, self.replication, self.handoffs)
        self.accounting = Accounting(self.metrics, self.request_log)
        self.fleet.listeners.append(IndexFeed(self))
        self._register_collectors()
        self.holder.subscribe(self.apply_config)

    async def start(self) -> None:
        self.build()
        self.hints.start()
        await self.fleet.start()
        await self.discovery.start()
        await self.holder.start()
        if self.warming:
            self._spawn(self._warm_start())
        self._spawn(self._calibration_loop())
        self._spawn(self.replication.run())

    async def stop(self) -> None:
        await self.hints.stop()
        await self.holder.stop()
        await self.discovery.stop()
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
        self.discovery.apply_config(config)
        self.router.apply_config(config)
        self.tenants = TenantResolver(config.tenants)
        if config.models != self.router.tokenizer_models:
            self._replace_tokenizer(config)
        self.tokenizer.set_limits(config.limits)
        self.proxy.config = config.proxy
        self.request_log.enabled = config.server.log_requests
        if hint_settings(config) != self._hints_settings:
            self._hints_settings = hint_settings(config)
            self._spawn(self._rebind_hints(config))

    def _hint_exchange(self, config: KvgateConfig) -> HintExchange:
        return HintExchange(config.peers, self.index, lambda name: name in self.fleet.replicas,
                            peer_token(config.server), self.instance, self.fleet.dispatched_work)

    def _wire_hints(self, config: KvgateConfig) -> None:
        """Routing publishes its predictions and replication its warm-ups, and the fleet adds the peers' dispatched
        work, through the exchange in force, as far as ``config`` turns them on. Replication shares its budget with
        the peers whose work reports count."""
        hints = self.hints
        self.router.on_predicted = hints.publish if config.peers.hints.bind else None
        self.replication.on_started = hints.publish_warming if config.peers.hints.bind else None
        hints.on_peer_warming = self.replication.peer_started
        sharing = config.peers.hints.work_ttl_s > 0
        self.fleet.peer_work = hints.peer_work if sharing else None
        self.replication.gateways = (lambda: 1 + hints.work.peers()) if sharing else (lambda: 1)

    async def _rebind_hints(self, config: KvgateConfig) -> None:
        """A reload that changed the hint exchange (endpoints, peers' DNS name, token): the old one's sockets close
        before the new one binds, so an unchanged ``bind`` is free again. Until it is up, routing goes on without
        hints; if it cannot start (its endpoint taken), it stays off and the error is logged."""
        async with self._hints_rebinding:
            old, new = self.hints, self._hint_exchange(config)
            new.stats = old.stats  # the counters run on across a reload
            await old.stop()
            self.hints = new
            self._wire_hints(config)  # a stopped or unstarted exchange publishes nothing and reports no peer work
            try:
                new.start()
            except (ValueError, zmq.ZMQError) as e:
                log.error("reload: routing hints are off until a reload changes them: %s", e)
                await new.stop()
                return
            log.info("reload: routing hints rebound")

    def _replace_tokenizer(self, config: KvgateConfig) -> None:
        """New model tokenizers take effect for new requests; a path that does not load keeps the old ones."""
        try:
            tokenizer = PromptTokenizer(config.models, engine_tokenize=self._engine_tokenize, limits=config.limits)
        except ConfigError as e:
            log.error("reload: keeping the previous tokenizers: %s", e)
            return
        old, self.tokenizer = self.tokenizer, tokenizer
        self.router.tokenizer = tokenizer
        self.router.tokenizer_models = config.models
        old.close()

    def _model_name_of(self, replica: Replica) -> str:
        """The model a replica's KV events belong to: its label ``model``, else the file's first model."""
        return replica.config.labels.get("model") or (self.config.models[0].name if self.config.models else "")

    def track_replica(self, replica: Replica) -> None:
        """Index this replica's KV events under its model's namespace."""
        cfg = replica.config
        model_name = self._model_name_of(replica)
        model = self.config.model(model_name)
        self.ingestor.add_replica(cfg.name, model=model_name, weight_version=model.weight_version if model else "")
        if self.warming:
            self._unsubscribed.add(cfg.name)
        elif cfg.kv_events:
            self.subscriptions.start(cfg.name, cfg.kv_events, cfg.kv_replay, cfg.kv_topic)

    def untrack_replica(self, name: str) -> None:
        self._unsubscribed.discard(name)
        self.ingestor.remove_replica(name)
        self.block_sizes.forget(name)
        self._spawn(self.subscriptions.stop(name))

    def _namespace_of(self, replica: Replica) -> tuple[str, str]:
        model_name = self._model_name_of(replica)
        model = self.config.model(model_name)
        return model_name, model.weight_version if model else ""

    async def _warm_start(self) -> None:
        """Take the prefix index from a peer (within ``peers.warm_start_timeout_s``), then subscribe to the
        engines' events, each stream resuming where the snapshot left it; without a snapshot, from scratch."""
        anchors: dict[tuple[str, int | None], tuple[int, bytes]] = {}
        try:
            applied = await self._take_snapshot()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not keep the gateway unsubscribed
            log.exception("warm start failed; starting cold")
        else:
            anchors = {} if applied is None else applied.anchors
        self.warming = False
        for name in sorted(self._unsubscribed):
            replica = self.fleet.replicas.get(name)
            cfg = None if replica is None else replica.config
            if cfg is not None and cfg.kv_events:
                subscriber = self.subscriptions.start(cfg.name, cfg.kv_events, cfg.kv_replay, cfg.kv_topic)
                anchor = anchors.get((name, subscriber.dp_rank))
                if anchor is not None:
                    subscriber.resume_after(*anchor)
        self._unsubscribed.clear()

    async def _take_snapshot(self) -> Applied | None:
        peers = self.config.peers
        loop = asyncio.get_running_loop()
        deadline = loop.time() + peers.warm_start_timeout_s
        taken = await take_from_peers(self.session, peers, peer_token(self.config.server), self.instance,
                                      peers.warm_start_timeout_s)
        if taken is None:
            log.warning("warm start: no peer gave a snapshot; starting cold")
            return None
        url, snapshot = taken
        await self._discovered(snapshot, min(deadline, loop.time() + self.config.discovery.interval_s))
        try:
            applied = apply_snapshot(snapshot, self.fleet, self.ingestor, self._namespace_of)
        except SnapshotRejected as e:
            log.warning("warm start: snapshot from %s rejected, starting cold: %s", url, e)
            return None
        log.info("warm start from %s: %d replicas imported, %d left out %s", url, len(applied.imported),
                 len(applied.left_out), applied.left_out)
        return applied

    async def _discovered(self, snapshot: Snapshot, deadline: float) -> None:
        """With discovery, wait (until ``deadline``) for the snapshot's replicas to be found, probed and scraped."""
        if self.config.discovery.kind == "none":
            return
        loop = asyncio.get_running_loop()
        names = [entry.name for entry in snapshot.replicas]
        while loop.time() < deadline:
            replicas = [self.fleet.replicas.get(name) for name in names]
            if all(r is not None and r.health.up is not None and r.scraped is not None for r in replicas):
                return
            await asyncio.sleep(0.05)

    def peer_snapshot(self, authorization: str | None, instance: str | None) -> Response:
        """This gateway's index, for a peer that is starting: the peer or admin token only, never a tenant's key."""
        self.credentials.require_peer(authorization)
        if instance == self.instance:
            raise ApiError(409, "This is the asking gateway itself.", code="same_instance")
        if self.warming:
            raise ApiError(503, "Warming up from a peer; no snapshot yet.", code="warming")
        raw = take_snapshot(self.fleet, self.ingestor, self.subscriptions)
        if len(raw) > self.config.peers.max_snapshot_bytes:
            raise ApiError(507, "The snapshot is larger than peers.max_snapshot_bytes.", code="snapshot_too_large")
        return Response(raw, media_type=SNAPSHOT_CONTENT_TYPE)

    def _scraped_block_size(self, name: str) -> int | None:
        replica = self.fleet.replicas.get(name)
        scraped = None if replica is None else replica.scraped
        return None if scraped is None else scraped.block_size

    def _block_size_stats(self) -> dict[str, dict[str, int]]:
        for replica in self.fleet.replicas.values():
            self.block_sizes.of(replica.name, self.config.model(self._model_name_of(replica)))
        return self.block_sizes.stats()

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
        m.add_stats(self.replication.counts, REPLICATION_SERIES)
        m.add_stats(self._block_size_stats, BLOCK_SIZE_SERIES)
        m.add_stats(lambda: self.hints.stats, HINT_SERIES)

    def _count_retry(self, cause: str) -> None:
        self.metrics.retries.labels(cause).inc()

    def _count_upstream_failure(self, replica: str, cause: str) -> None:
        self.metrics.upstream_failures.labels(replica, cause).inc()

    async def _engine_tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize`` on a routable replica: the tokenizer's fallback for models with no local tokenizer."""
        replicas = self.fleet.routable()
        if not replicas:
            raise NoHealthyReplica("no routable replica to tokenize on")
        timeout = aiohttp.ClientTimeout(total=self.config.proxy.first_byte_timeout_s)
        async with self.session.post(replicas[0].url + "/tokenize", json=payload, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json()

    # the endpoints' request paths

    async def generate(self, request: Request, endpoint: Endpoint, path: str) -> Response:
        """Completions and chat completions: admit → parse → tokenize → route → forward → account."""
        admission = Admission.of(request.scope)
        try:
            admission.tenant = resolve_tenant(self.tenants, admission.client.authorization)
            check_client_ids(admission.client, self.config.limits)
            raw = await read_within_limits(request, self.config.server, self.config.limits)
            parsed = salt_for_tenant(parse(raw, self.router, self._may_use(admission.tenant)), self.tenants,
                                     admission.tenant)
            prompt = await tokenize(self.router, endpoint, parsed)
            routed = route(self.router, prompt, admission)
        except ApiError as e:
            self.accounting.rejected(e, admission)
            raise
        self.accounting.decided(routed)
        headers = upstream_headers(admission.client, admission.request_id, self.tenants.enabled)
        proxy_config = self.config.proxy
        try:
            up = await self.forwarder.send(request, path, parsed, routed, headers, proxy_config)
        except AttemptFailed as failed:
            return self.accounting.failed(failed, routed, admission, proxy_config.max_attempts)
        if up is None:
            return self.accounting.client_left(routed, admission)

        def finished(up: Upstream, result: StreamResult | None) -> None:
            self.accounting.answered(routed, admission, up, result)

        return relay(up, routed, admission.request_id, parsed.stream, finished)

    async def passthrough(self, request: Request, path: str) -> Response:
        """Requests with no prompt prefix to match (embeddings): admit → parse → least-loaded replica → forward, the
        body unchanged."""
        admission = Admission.of(request.scope)
        try:
            admission.tenant = resolve_tenant(self.tenants, admission.client.authorization)
            check_client_ids(admission.client, self.config.limits)
            raw = await read_within_limits(request, self.config.server, self.config.limits)
            parsed = parse(raw, self.router, self._may_use(admission.tenant))
            with routing_errors():
                decision = self.router.route_passthrough(parsed.model)
        except ApiError as e:
            self.accounting.rejected(e, admission)
            raise
        request_id = admission.request_id
        dispatcher = FleetDispatcher(self.fleet, lambda _: 0, admission.tenant)
        fwd = Forward(path, parsed.raw, upstream_headers(admission.client, request_id, self.tenants.enabled), False,
                      decision.ranked, self.config.proxy.max_attempts)
        try:
            up = await self.proxy.forward(fwd, dispatcher)
        except AttemptFailed as failed:
            err = failed.to_api_error()
            self.metrics.requests.labels("", str(failed.status or err.status), decision.reason).inc()
            return err.response({"x-request-id": request_id})
        up.settle()
        self.metrics.requests.labels(up.replica, str(up.status), decision.reason).inc()
        out_headers = up.client_headers()
        out_headers.update({"x-request-id": request_id, "x-kvgate-replica": up.replica,
                            "x-kvgate-decision": decision.reason})
        return Response(up.body, status_code=up.status, headers=out_headers)

    def _may_use(self, tenant: str | None) -> Callable[[str], bool]:
        """Which models ``tenant`` may use (``tenants.models``)."""
        return functools.partial(self.tenants.may_use, tenant)

    def require_caller(self, client: ClientHeaders) -> tuple[str | None, bool]:
        """Who may send requests may also list models: with tenants, a tenant key or the admin token (else 401).
        The caller's tenant, and whether it is the admin."""
        if self.credentials.is_admin(client.authorization):
            return None, True
        return resolve_tenant(self.tenants, client.authorization), False

    def may_call(self, client: ClientHeaders) -> bool:
        try:
            self.require_caller(client)
        except ApiError:
            return False
        return True

    def models_for(self, client: ClientHeaders) -> list[dict[str, Any]]:
        """``/v1/models`` as the caller may see it: the admin every model as the engines list them; anyone else only
        the models and adapters its tenant may use, without the engines' filesystem paths (``root``)."""
        tenant, admin = self.require_caller(client)
        models = self.fleet.models()
        if admin:
            return models
        return [{k: v for k, v in m.items() if k != "root"} for m in models if self.tenants.may_use(tenant, m["id"])]

    @property
    def credentials(self) -> Credentials:
        """kvgate's own tokens in force (the policy file's, else the environment's)."""
        return Credentials.of(self.config.server)

    def _explain_caller(self, client: ClientHeaders, headers: Headers) -> tuple[str | None, bool]:
        """Whom explain answers: (tenant whose namespace is looked up, whether the caller sees everything).

        The admin token sees everything, in the namespace of the tenant named by ``X-Kvgate-Tenant`` (none: requests
        without a tenant). Otherwise explain answers whoever may send requests: with tenants, a tenant key, in that
        tenant's own namespace and without any figure that moves with other tenants' traffic
        (:func:`~kvgate.router.http.explain.tenant_view`)."""
        if self.credentials.is_admin(client.authorization):
            return headers.get("x-kvgate-tenant") or None, True
        tenant = resolve_tenant(self.tenants, client.authorization)
        return tenant, tenant is None

    async def explain(self, request: Request) -> dict[str, Any]:
        """Route a completions or chat body without sending it: admit → parse → tokenize → route, then the decision
        and the numbers behind it."""
        admission = Admission.of(request.scope)
        admission.tenant, full = self._explain_caller(admission.client, request.headers)
        check_client_ids(admission.client, self.config.limits)
        raw = await read_within_limits(request, self.config.server, self.config.limits)
        may_use = (lambda model: True) if full else self._may_use(admission.tenant)
        parsed = salt_for_tenant(parse(raw, self.router, may_use), self.tenants, admission.tenant)
        endpoint: Endpoint = "chat" if "messages" in parsed.body else "completions"
        prompt = await tokenize(self.router, endpoint, parsed)
        routed = route(self.router, prompt, admission, explain=True)
        explained = explain_body(routed, self.config.policy.name, self.index.generation)
        return explained if full else tenant_view(explained)

    async def ingest_events(self, request: Request) -> dict[str, Any]:
        """KV events over HTTP, for engines that cannot reach kvgate over ZMQ (same sequence rules). Off unless an
        events token is configured, and then only for callers presenting it (it writes the index)."""
        headers = request.headers
        self.credentials.require_events(headers.get("authorization"))
        server = self.config.server
        raw = await read_body(request, server.max_event_body_bytes, server.body_timeout_s, None)
        decode = functools.partial(
            decode_http_frame, headers.get("x-kvgate-replica"), raw, headers.get("content-type"),
            seq=_int_header(headers, "x-kvgate-seq"), dp_rank=_int_header(headers, "x-kvgate-dp-rank"),
        )
        try:  # decoding is pure: off the loop, which applying (bounded below) is not
            frame = await asyncio.get_running_loop().run_in_executor(None, decode)
        except HttpIngestError as e:
            raise ApiError(400, str(e), code="invalid_events") from e
        if frame.blocks > server.max_event_blocks:
            raise ApiError(413, f"the batch holds {frame.blocks} blocks; the limit is {server.max_event_blocks} "
                           "(split it, one sequence number each)", code="request_too_large")
        result = apply_http_frame(self.ingestor, frame)
        return {"status": result.status.name.lower(), "events": result.events}


def _int_header(headers: Headers, name: str) -> int | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"header {name} must be an integer", param=name, code="invalid_header") from None
