"""Warm start: a starting gateway takes its prefix index from a running peer instead of starting cold.

Peers are the policy file's ``peers.urls`` and the addresses of the gateways' headless Service (``peers.dns``,
resolved as engine discovery resolves the engines'). They are asked in random order for ``GET
/kvgate/v1/peer/snapshot`` with the peer token; the first good snapshot wins. A peer that is itself warming up
answers 503 and is asked again in the next round; a gateway never takes its own snapshot (the request carries this
process's instance id, and a gateway answers its own with 409). Rounds go on while some peer may still answer and
the time allowed (``peers.warm_start_timeout_s``) lasts: with no peer to ask, or none able to give a snapshot, the
gateway goes on cold at once.
"""

from __future__ import annotations

import asyncio
import logging
import random

import aiohttp

from kvgate.router.fleet.config import DiscoveryConfig, DiscoveryPorts
from kvgate.router.fleet.discovery.dns import DnsSource, ResolutionFailed
from kvgate.router.peers.config import PeersConfig
from kvgate.router.peers.snapshot import CONTENT_TYPE, Snapshot, SnapshotRejected, decode_snapshot

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
    session: aiohttp.ClientSession, url: str, token: str | None, instance: str, max_bytes: int, timeout_s: float
) -> Snapshot:
    """One peer's snapshot, decoded and checked. :class:`Unavailable` when it is warming up, :class:`Itself` when it is
    the asking gateway; any other failure
    raises :class:`SnapshotRejected`, ``aiohttp.ClientError`` or ``TimeoutError``."""
    headers = {INSTANCE_HEADER: instance, "accept": CONTENT_TYPE}
    if token:
        headers["authorization"] = f"Bearer {token}"
    async with session.get(url + SNAPSHOT_PATH, headers=headers,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status == 503:
            raise Unavailable()
        if resp.status == 409:
            raise Itself()
        if resp.status != 200:
            raise SnapshotRejected(f"answered {resp.status}")
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise SnapshotRejected(f"{resp.content_length} bytes, more than peers.max_snapshot_bytes")
        body = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 20):
            body += chunk
            if len(body) > max_bytes:
                raise SnapshotRejected("more than peers.max_snapshot_bytes")
    return decode_snapshot(bytes(body))


async def take_from_peers(
    session: aiohttp.ClientSession, config: PeersConfig, token: str | None, instance: str, timeout_s: float
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
                return url, await fetch_snapshot(session, url, token, instance, config.max_snapshot_bytes, left)
            except Unavailable:
                retry = True
            except Itself:
                pass
            except SnapshotRejected as e:
                log.warning("peers: snapshot from %s rejected: %s", url, e)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                log.info("peers: %s unreachable: %s", url, e or type(e).__name__)
        if not retry or loop.time() + RETRY_INTERVAL_S >= deadline:
            return None
        await asyncio.sleep(RETRY_INTERVAL_S)
