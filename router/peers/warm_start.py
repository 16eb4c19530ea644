"""Warm start: a starting gateway takes its prefix index from a running peer instead of starting cold
(:class:`WarmStart`).

Peers are the policy file's ``peers.urls`` and the addresses of the gateways' headless Service (``peers.dns``,
resolved as engine discovery resolves the engines'). They are asked in random order for ``GET
/kvgate/v1/peer/snapshot`` with the peer token; the first good snapshot wins. A peer that is itself warming up
answers 503 and is asked again in the next round; a gateway never takes its own snapshot (the request carries this
process's instance id, and a gateway answers its own with 409). Rounds go on while some peer may still answer and
the time allowed (``peers.warm_start_timeout_s``) lasts: with no peer to ask, or none able to give a snapshot, the
gateway goes on cold at once. Either way the index's event subscriptions then start (:meth:`IndexFeed.release
<kvgate.router.indexing.IndexFeed.release>`), each stream resuming where the snapshot left it.
"""

from __future__ import annotations

import asyncio
import logging
import random

from kvgate.cache_index.ingest import EventIngestor
from kvgate.router.fleet.config import DiscoveryConfig, DiscoveryPorts
from kvgate.router.fleet.discovery.dns import DnsSource, ResolutionFailed
from kvgate.router.fleet.state import Fleet
from kvgate.router.indexing import Anchors, IndexFeed
from kvgate.router.peers.config import PeersConfig
from kvgate.router.peers.snapshot import (
    CONTENT_TYPE, Applied, Snapshot, SnapshotRejected, apply_snapshot, decode_snapshot,
)
from kvgate.router.upstream.client import EngineClient, UpstreamBodyTooLarge, UpstreamError

log = logging.getLogger(__name__)

SNAPSHOT_PATH = "/kvgate/v1/peer/snapshot"
INSTANCE_HEADER = "x-kvgate-instance"
RETRY_INTERVAL_S = 0.25
"""Between rounds of asking peers that were warming up themselves."""


class Unavailable(Exception):
    """This peer cannot give a snapshot now, but may soon (it is warming up itself)."""


class Itself(Exception):
    """The peer is the asking gateway."""


async def peer_urls(config: PeersConfig) -> list[str]:
    """The configured peers and those the DNS name lists now (a failed resolution adds none)."""
    urls = list(config.urls)
    if config.dns.name:
        ports = DiscoveryPorts(http=config.port, kv_events=None, kv_replay=None)
        source = DnsSource(DiscoveryConfig(kind="dns", dns=config.dns, ports=ports, scheme=config.scheme))
        try:
            targets = await source.resolve()
        except ResolutionFailed as e:
            log.warning("peers: resolving %s failed: %s", config.dns.name, e)
        else:
            urls.extend(target.config.url for target in targets.values() if target.config.url not in urls)
    return urls


async def fetch_snapshot(
    client: EngineClient, url: str, token: str | None, instance: str, max_bytes: int, timeout_s: float
) -> Snapshot:
    """One peer's snapshot, decoded and checked. :class:`Unavailable` when it is warming up, :class:`Itself` when it is
    the asking gateway; any other failure raises :class:`SnapshotRejected`,
    :class:`~kvgate.router.upstream.client.UpstreamError` or ``TimeoutError``."""
    headers = {INSTANCE_HEADER: instance, "accept": CONTENT_TYPE}
    if token:
        headers["authorization"] = f"Bearer {token}"
    try:
        answer = await client.fetch("GET", url + SNAPSHOT_PATH, headers, timeout_s=timeout_s, max_bytes=max_bytes)
    except UpstreamBodyTooLarge:
        raise SnapshotRejected("more than peers.max_snapshot_bytes") from None
    if answer.status == 503:
        raise Unavailable()
    if answer.status == 409:
        raise Itself()
    if answer.status != 200:
        raise SnapshotRejected(f"answered {answer.status}")
    return decode_snapshot(answer.body)


async def take_from_peers(
    client: EngineClient, config: PeersConfig, token: str | None, instance: str, timeout_s: float
) -> tuple[str, Snapshot] | None:
    """The first good snapshot a peer gives within ``timeout_s`` (its URL and the snapshot), or None."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        urls = await peer_urls(config)
        random.shuffle(urls)
        retry = False
        for url in urls:
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                return url, await fetch_snapshot(client, url, token, instance, config.max_snapshot_bytes, left)
            except Unavailable:
                retry = True
            except Itself:
                pass
            except SnapshotRejected as e:
                log.warning("peers: snapshot from %s rejected: %s", url, e)
            except (UpstreamError, TimeoutError, OSError, ValueError) as e:
                log.info("peers: %s unreachable: %s", url, e or type(e).__name__)
        if not retry or loop.time() + RETRY_INTERVAL_S >= deadline:
            return None
        await asyncio.sleep(RETRY_INTERVAL_S)


class WarmStart:
    """Takes the prefix index from a peer (within ``peers.warm_start_timeout_s``), then releases the index's event
    subscriptions, each stream resuming where the snapshot left it; without a snapshot, from scratch. Until then
    the gateway is not ready, and gives no snapshot itself (``warming``)."""

    def __init__(
        self, client: EngineClient, peers: PeersConfig, token: str | None, instance: str, fleet: Fleet,
        ingestor: EventIngestor, feed: IndexFeed, discovery: DiscoveryConfig,
    ) -> None:
        self.client = client
        self.peers = peers
        self.token = token
        self.instance = instance
        self.fleet = fleet
        self.ingestor = ingestor
        self.feed = feed
        self.discovery = discovery
        self.warming = peers.enabled and peers.warm_start_timeout_s > 0
        """Taking the prefix index from a peer: not ready, and event subscriptions wait."""

    async def run(self) -> None:
        anchors: Anchors = {}
        try:
            applied = await self._take_snapshot()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not keep the gateway unsubscribed
            log.exception("warm start failed; starting cold")
        else:
            anchors = {} if applied is None else applied.anchors
        self.warming = False
        self.feed.release(anchors)

    async def _take_snapshot(self) -> Applied | None:
        peers = self.peers
        loop = asyncio.get_running_loop()
        deadline = loop.time() + peers.warm_start_timeout_s
        taken = await take_from_peers(self.client, peers, self.token, self.instance, peers.warm_start_timeout_s)
        if taken is None:
            log.warning("warm start: no peer gave a snapshot; starting cold")
            return None
        url, snapshot = taken
        await self._discovered(snapshot, min(deadline, loop.time() + self.discovery.interval_s))
        try:
            applied = apply_snapshot(snapshot, self.fleet, self.ingestor, self.feed.namespace_of)
        except SnapshotRejected as e:
            log.warning("warm start: snapshot from %s rejected, starting cold: %s", url, e)
            return None
        log.info("warm start from %s: %d replicas imported, %d left out %s", url, len(applied.imported),
                 len(applied.left_out), applied.left_out)
        return applied

    async def _discovered(self, snapshot: Snapshot, deadline: float) -> None:
        """With discovery, wait (until ``deadline``) for the snapshot's replicas to be found, probed and scraped."""
        if self.discovery.kind == "none":
            return
        loop = asyncio.get_running_loop()
        names = [entry.name for entry in snapshot.replicas]
        while loop.time() < deadline:
            replicas = [self.fleet.replicas.get(name) for name in names]
            if all(r is not None and r.health.up is not None and r.scraped is not None for r in replicas):
                return
            await asyncio.sleep(0.05)
