"""The prefix index's replicas, kept in step with the fleet: one owner for which model a replica's KV events belong
to, the index's replicas (its ingestor's) and their event subscriptions.

A replica that joins the fleet is added to the ingestor under its model's namespace (model, weight version) and
subscribed to; one that leaves is removed and unsubscribed; the fleet's health transitions become the index's
resets, recoveries and restarts. While the gateway takes its index from a peer (warm start), subscriptions wait:
:meth:`IndexFeed.release` starts them, each stream resuming after the frame the snapshot left it at.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.router.fleet.block_sizes import BlockSizes
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet, FleetListener
from kvgate.router.routing.catalog import ModelCatalog

Anchors = Mapping[tuple[str, int | None], tuple[int, bytes]]
"""Per (replica, DP rank) stream: the sequence number and bytes of the last frame a snapshot applied."""


class IndexFeed(FleetListener):
    def __init__(
        self, catalog: ModelCatalog, fleet: Fleet, ingestor: EventIngestor, subscriptions: SubscriptionManager,
        block_sizes: BlockSizes, spawn: Callable[[Coroutine[Any, Any, None]], None], *, held: bool,
    ) -> None:
        self.catalog = catalog
        self.fleet = fleet
        self.ingestor = ingestor
        self.subscriptions = subscriptions
        self.block_sizes = block_sizes
        self.spawn = spawn
        self.held = held
        """Subscriptions wait for :meth:`release` (the gateway is taking its index from a peer)."""
        self._waiting: set[str] = set()

    def namespace_of(self, replica: Replica) -> tuple[str, str]:
        """The (model, weight version) a replica's KV events are indexed under."""
        model_name = self.catalog.model_of(replica)
        model = self.catalog.config_of(model_name)
        return model_name, model.weight_version if model else ""

    def release(self, anchors: Anchors) -> None:
        """Subscribe to the replicas that waited, each stream resuming after its anchor (the last frame a snapshot
        applied), from scratch without one."""
        self.held = False
        for name in sorted(self._waiting):
            replica = self.fleet.replicas.get(name)
            cfg = None if replica is None else replica.config
            if cfg is not None and cfg.kv_events:
                subscriber = self.subscriptions.start(cfg.name, cfg.kv_events, cfg.kv_replay, cfg.kv_topic)
                anchor = anchors.get((name, subscriber.dp_rank))
                if anchor is not None:
                    subscriber.resume_after(*anchor)
        self._waiting.clear()

    # the fleet's events

    def on_added(self, replica: Replica) -> None:
        cfg = replica.config
        model, weight_version = self.namespace_of(replica)
        self.ingestor.add_replica(cfg.name, model=model, weight_version=weight_version)
        if self.held:
            self._waiting.add(cfg.name)
        elif cfg.kv_events:
            self.subscriptions.start(cfg.name, cfg.kv_events, cfg.kv_replay, cfg.kv_topic)

    def on_removed(self, name: str) -> None:
        self._waiting.discard(name)
        self.ingestor.remove_replica(name)
        self.block_sizes.forget(name)
        self.spawn(self.subscriptions.stop(name))

    def on_reset(self, name: str, reason: str) -> None:
        self.ingestor.reset_replica(name, reason)

    def on_recovered(self, name: str, started_at: float | None) -> None:
        self.ingestor.engine_recovered(name, started_at)

    def on_restarted(self, name: str, started_at: float) -> None:
        self.ingestor.engine_started(name, started_at)
