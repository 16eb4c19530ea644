"""The hint exchange in force (:class:`~kvgate.router.peers.hints.HintExchange`) and what it is wired to.

Routing publishes its predictions and replication its warm-ups through it; replication hears of the peers' warm-ups
and shares its warm-up budget with the peers whose work reports count; the fleet adds the peers' dispatched work to
its own when it estimates a replica's queue. A reload that changes the exchange's settings (its endpoints, the
peers' DNS name, the token that keys it) rebinds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from kvgate.cache_index.index import PrefixIndex
from kvgate.router.core.auth import peer_token
from kvgate.router.core.config import ServerConfig
from kvgate.router.fleet.state import Fleet
from kvgate.router.peers.config import PeersConfig
from kvgate.router.peers.hints import HintExchange, HintStats
from kvgate.router.routing.predictions import Predictions
from kvgate.router.routing.replication import Replication

log = logging.getLogger(__name__)


def hint_settings(peers: PeersConfig, server: ServerConfig) -> tuple[object, ...]:
    """What the hint exchange is built from: a reload that changes any of it rebinds the exchange."""
    return peers.hints, peers.dns, peer_token(server)


class PeerHints:
    def __init__(
        self, peers: PeersConfig, server: ServerConfig, index: PrefixIndex, fleet: Fleet, predictions: Predictions,
        replication: Replication, instance: str, spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.index = index
        self.fleet = fleet
        self.predictions = predictions
        self.replication = replication
        self.instance = instance
        """This gateway's id among its peers (it ignores its own messages)."""
        self.spawn = spawn
        self._settings = hint_settings(peers, server)
        self._rebinding = asyncio.Lock()
        self.exchange = self._exchange(peers, server)
        self._wire(peers)

    @property
    def stats(self) -> HintStats:
        return self.exchange.stats

    def start(self) -> None:
        self.exchange.start()

    async def stop(self) -> None:
        await self.exchange.stop()

    def reconfigure(self, peers: PeersConfig, server: ServerConfig) -> None:
        if hint_settings(peers, server) != self._settings:
            self._settings = hint_settings(peers, server)
            self.spawn(self._rebind(peers, server))

    def _exchange(self, peers: PeersConfig, server: ServerConfig) -> HintExchange:
        return HintExchange(peers, self.index, lambda name: name in self.fleet.replicas, peer_token(server),
                            self.instance, self.fleet.dispatched_work)

    def _wire(self, peers: PeersConfig) -> None:
        """Through the exchange in force, as far as ``peers`` turns each part on."""
        exchange = self.exchange
        publishes = bool(peers.hints.bind)
        self.predictions.on_predicted = exchange.publish if publishes else None
        self.replication.on_started = exchange.publish_warming if publishes else None
        exchange.on_peer_warming = self.replication.peer_started
        sharing = peers.hints.work_ttl_s > 0
        self.fleet.peer_work = exchange.work if sharing else None

    async def _rebind(self, peers: PeersConfig, server: ServerConfig) -> None:
        """The old exchange's sockets close before the new one binds, so an unchanged ``bind`` is free again. Until
        it is up, routing goes on without hints; if it cannot start (its endpoint taken), it stays off and the error
        is logged."""
        async with self._rebinding:
            old, new = self.exchange, self._exchange(peers, server)
            new.stats = old.stats  # the counters run on across a reload
            await old.stop()
            self.exchange = new
            self._wire(peers)  # a stopped or unstarted exchange publishes nothing and reports no peer work
            try:
                new.start()
            except (ValueError, zmq.ZMQError) as e:
                log.error("reload: routing hints are off until a reload changes them: %s", e)
                await new.stop()
                return
            log.info("reload: routing hints rebound")
