"""The gateway as a container: every component of one running gateway, built in dependency order
(:meth:`Gateway.build`), started, stopped, and reconfigured from a reloaded policy file (:meth:`Gateway.reconfigure`,
the one way a reload reaches a component: each is handed its own sections).

The endpoint flows (:mod:`kvgate.router.endpoints`) are composed from these components by the app
(:mod:`kvgate.router.app.gateway_app`); nothing here handles a request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.router.admission.gate import AdmissionGate
from kvgate.router.admission.saturation import Saturation
from kvgate.router.core.auth import peer_token
from kvgate.router.core.logs import RequestLogger
from kvgate.router.core.metrics import (
    BLOCK_SIZE_SERIES,
    CONFIG_SERIES,
    HINT_SERIES,
    INDEX_SERIES,
    INGEST_SERIES,
    PARITY_SERIES,
    PREFILL_SERIES,
    REPLICATION_SERIES,
    TOKENIZER_SERIES,
    GatewayMetrics,
    ReplicaStateCollector,
)
from kvgate.router.core.tenants import TenantResolver, salt_secret
from kvgate.router.fleet.attempts import Attempts
from kvgate.router.fleet.block_sizes import BlockSizes
from kvgate.router.fleet.blindness import BlindnessCollector
from kvgate.router.fleet.discovery import Discovery
from kvgate.router.fleet.state import Fleet
from kvgate.router.indexing import IndexFeed
from kvgate.router.peers.warm_start import WarmStart
from kvgate.router.peers.wiring import PeerHints
from kvgate.router.pipeline.account import Accounting
from kvgate.router.pipeline.forward import Forwarder
from kvgate.router.pipeline.queue import QueueStage
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage
from kvgate.router.pipeline.tracing import TracingConfig, tracing_on
from kvgate.router.prompts.tokenizer import PromptTokenizer
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.handoff.base import Handoffs
from kvgate.router.routing.handoff.sglang import SglangHandoff
from kvgate.router.routing.handoff.vllm import VllmHandoff
from kvgate.router.routing.model_state import ModelStates, RoutingSettings
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.routing.predictions import Predictions
from kvgate.router.routing.replication import Replication
from kvgate.router.routing.sessions import SessionMemory
from kvgate.router.routing.stored_responses import ResponseIds, StoredResponses
from kvgate.router.routing.transfers import TransferRunner
from kvgate.router.routing.views import ReplicaViews
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import KvgateConfig
from kvgate.router.upstream.client import EngineClient
from kvgate.router.upstream.proxy import Proxy
from kvgate.router.upstream.tokenize import EngineTokenizer

if TYPE_CHECKING:
    from kvgate.router.pipeline.spans import RequestTracer

log = logging.getLogger(__name__)


def response_id_secret(config: KvgateConfig) -> bytes | None:
    """What response ids are signed with: the tenants' salt secret, else the peer token (both the same on every
    gateway of a fleet, so a follow-up may reach any of them), else none (a random key of this process)."""
    if config.tenants.enabled:
        return salt_secret(config.tenants)
    token = peer_token(config.server)
    return token.encode() if token else None


def start_tracing(
    config: TracingConfig, replica_at: Callable[[str], str | None], environ: Mapping[str, str] = os.environ
) -> RequestTracer | None:
    """The gateway's tracer, exporting in the background; None when tracing is off
    (:func:`~kvgate.router.pipeline.tracing.tracing_on`). ``replica_at`` names the replica an engine URL belongs to.

    Tracing wanted without the OpenTelemetry SDK installed (the ``otel`` extra) is one warning and a gateway that
    runs untraced, passing clients' trace context on unchanged: traces are a diagnostic, and a gateway that would not
    start for want of one would cost more than the traces are worth."""
    if not tracing_on(config, environ):
        return None
    try:
        from kvgate.router.pipeline.spans import RequestTracer

        return RequestTracer.start(config, replica_at, environ)
    except ImportError as e:
        log.warning("tracing is configured but the OpenTelemetry SDK is not installed (no module %r): kvgate runs "
                    "without tracing and passes clients' trace context on unchanged; install it with "
                    "pip install 'kvgate[otel]'", e.name)
        return None


def routing_settings(config: KvgateConfig) -> RoutingSettings:
    return RoutingSettings(config.policy, config.calibration, config.transfer, config.disaggregation,
                           config.replication)


class Gateway:
    """Everything one running gateway owns."""

    def __init__(self, holder: ConfigHolder) -> None:
        self.holder = holder
        self.metrics = GatewayMetrics()
        self.request_log = RequestLogger(holder.current.server.log_requests)
        self.instance = secrets.token_hex(8)
        """Tells this process apart from its peers (it never takes its own snapshot)."""
        self._background: set[asyncio.Task[None]] = set()

    def build(self) -> None:
        """Every component, in dependency order, from the policy file in force. Run on the event loop (the upstream
        session binds to it), by :meth:`start`."""
        config = self.holder.current
        rng = random.Random()
        self.tracing = config.tracing
        """The tracing section read at startup (a reload does not change it)."""
        self.tracer = start_tracing(config.tracing, self._replica_at)
        """None when the gateway does not trace (the stages then find no trace on a request)."""
        self.engines = EngineClient(config.proxy.pool_size_per_replica)
        self.proxy = Proxy(self.engines, config.proxy)
        self.fleet = Fleet(config.replicas, self.engines, health=config.health, scrape=config.scrape,
                           breaker=config.breaker)
        self.attempts = Attempts(self.proxy, self.fleet, self.metrics, rng)
        self.discovery = Discovery(config.discovery, config.replicas, self.fleet)
        self.catalog = ModelCatalog(config.models, self.fleet)
        self.index = PrefixIndex(config.index.max_entries, config.index.predicted_ttl_s)
        self.ingestor = EventIngestor(self.index)
        self.subscriptions = SubscriptionManager(self.ingestor, replay_timeout_s=config.index.replay_timeout_s)
        self.block_sizes = BlockSizes(self.ingestor.block_size, self._scraped_block_size)
        self.engine_tokenizer = EngineTokenizer(self.engines, self.fleet.routable, config.proxy.first_byte_timeout_s)
        self.tokenizer = PromptTokenizer(config.models, engine_tokenize=self.engine_tokenizer, limits=config.limits)
        self.tenants = TenantResolver(config.tenants)
        self.models = ModelStates(self.catalog, routing_settings(config), rng)
        self.views = ReplicaViews(self.fleet, self.index)
        self.sessions = SessionMemory(config.limits.max_sessions_per_tenant)
        self.predictions = Predictions(self.index, self.sessions)
        self.transfers = TransferRunner(self.attempts, self.metrics, config.transfer)
        self.replication = Replication(self.models, self.views, self.fleet, self.index, self.attempts, self.transfers,
                                       self.metrics, self.spawn)
        self.hints = PeerHints(config.peers, config.server, self.index, self.fleet, self.predictions,
                               self.replication, self.instance, self.spawn)
        self.sglang_handoff = SglangHandoff(self.attempts, self.transfers, config.transfer)
        self.handoffs = Handoffs({"vllm": VllmHandoff(self.transfers), "sglang": self.sglang_handoff})
        warming = config.peers.enabled and config.peers.warm_start_timeout_s > 0
        self.feed = IndexFeed(self.catalog, self.fleet, self.ingestor, self.subscriptions, self.block_sizes,
                              self.spawn, held=warming)
        self.warm_start = WarmStart(self.engines, config.peers, peer_token(config.server), self.instance, self.fleet,
                                    self.ingestor, self.feed, config.discovery)
        self.parity = ParityMonitor(config.parity, self.metrics)
        self.stored_responses = StoredResponses(config.responses)
        self.response_ids = ResponseIds(response_id_secret(config))
        self.tokenize_stage = TokenizeStage(self.catalog, self.models, self.tokenizer, self.parity)
        self.route_stage = RouteStage(self.catalog, self.index, self.block_sizes, self.views, self.sessions,
                                      self.metrics, config.proxy, rng)
        self.admission = AdmissionGate(config.admission, Saturation(self.fleet), self.metrics,
                                       gateways=self.replication.gateways)
        self.queue_stage = QueueStage(self.admission)
        self.forwarder = Forwarder(self.attempts, self.fleet, self.predictions, self.replication, self.handoffs,
                                   config.proxy)
        self.accounting = Accounting(self.metrics, self.request_log, self.parity, self.predictions)
        self.fleet.listeners.append(self.feed)
        self._register_collectors()
        self.holder.subscribe(self.reconfigure)

    async def start(self) -> None:
        self.build()
        self.hints.start()
        await self.fleet.start()
        await self.discovery.start()
        await self.holder.start()
        if self.warm_start.warming:
            self.spawn(self.warm_start.run())
        self.spawn(self.models.run_calibration())
        self.spawn(self.replication.run())

    async def stop(self) -> None:
        await self.hints.stop()
        await self.holder.stop()
        await self.discovery.stop()
        await self.fleet.stop()
        await self.subscriptions.stop_all()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self.admission.close()
        self.tokenizer.close()
        await self.engines.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)

    def reconfigure(self, config: KvgateConfig) -> None:
        """A reloaded policy file, each component handed its sections; requests in flight keep what they started
        with."""
        self.fleet.reconfigure(config.replicas, health=config.health, scrape=config.scrape, breaker=config.breaker)
        self.discovery.reconfigure(config.discovery, config.replicas)
        self.catalog.reconfigure(config.models)
        self.models.reconfigure(routing_settings(config))
        self.tenants.reconfigure(config.tenants)
        self.tokenizer.reconfigure(config.models, config.limits)
        self.engine_tokenizer.reconfigure(config.proxy.first_byte_timeout_s)
        self.sessions.reconfigure(config.limits.max_sessions_per_tenant)
        self.proxy.reconfigure(config.proxy)
        self.route_stage.reconfigure(config.proxy)
        self.forwarder.reconfigure(config.proxy)
        self.transfers.reconfigure(config.transfer)
        self.sglang_handoff.reconfigure(config.transfer)
        self.request_log.reconfigure(config.server.log_requests)
        self.hints.reconfigure(config.peers, config.server)
        self.parity.reconfigure(config.parity)
        self.stored_responses.reconfigure(config.responses)
        self.admission.reconfigure(config.admission)
        if config.tracing != self.tracing:
            log.warning("the tracing section changed: it is read at startup, so the change takes effect when kvgate "
                        "restarts")

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or the gateway stops."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _replica_at(self, url: str) -> str | None:
        """The replica an engine request's URL goes to (its URL followed by the path), for the attempts' spans."""
        for replica in self.fleet.replicas.values():
            if url.startswith(replica.url) and url[len(replica.url):len(replica.url) + 1] in ("/", "?", ""):
                return replica.name
        return None

    def _scraped_block_size(self, name: str) -> int | None:
        replica = self.fleet.replicas.get(name)
        scraped = None if replica is None else replica.scraped
        return None if scraped is None else scraped.block_size

    def _block_size_stats(self) -> dict[str, dict[str, int]]:
        for replica in self.fleet.replicas.values():
            self.block_sizes.of(replica.name, self.catalog.config_of(self.catalog.model_of(replica)))
        return self.block_sizes.stats()

    def _register_collectors(self) -> None:
        m = self.metrics
        m.add_collector(ReplicaStateCollector(lambda: list(self.fleet.replicas.values())))
        m.add_collector(BlindnessCollector(self.fleet.blindness, self.fleet.unseen_rates))
        m.add_stats(self.index.stats, INDEX_SERIES)
        m.add_stats(lambda: self.ingestor.stats, INGEST_SERIES)
        m.add_stats(lambda: self.tokenizer.stats, TOKENIZER_SERIES)
        m.add_stats(lambda: self.holder, CONFIG_SERIES)
        m.add_stats(self.models.coefficients, PREFILL_SERIES)
        m.add_stats(self.replication.counts, REPLICATION_SERIES)
        m.add_stats(self._block_size_stats, BLOCK_SIZE_SERIES)
        m.add_stats(lambda: self.hints.stats, HINT_SERIES)
        m.add_stats(self.parity.stats, PARITY_SERIES)

