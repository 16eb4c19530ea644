"""Routing hints between gateway replicas: the prompts each one just routed, credited by the others as predicted, and
the work each has dispatched.

A gateway predicts a prompt's blocks on the replica it sends it to until the engine's events confirm them; without
hints, a sibling request that reaches another gateway first misses that prediction and may be placed cold
elsewhere. With ``peers.hints``, every gateway publishes each prediction on a ZMQ PUB socket and subscribes to its
peers': one message ``[2, sent_at, sender, replica, keys]`` (msgpack; keys as packed little-endian uint64s).

At each dispatch, and otherwise when it changed, it also publishes the work it has dispatched per replica, ``[4,
sent_at, sender, [[replica, prefill tokens, requests prefilling, requests per second], ...]]``, which its peers add to
their own when they estimate a replica's queue and arrival rate (:mod:`kvgate.router.fleet.peer_work`). A gateway of
another version speaks another format number: the two ignore each other's reports (counted as dropped) and route on
their own view.

When it starts warming a hot prefix on another replica (hot-prefix replication), it says so, ``[5, sent_at, sender,
target, prefix key]``, and its peers plan no warm-up of that prefix until the target holds it (or the warm-up times
out): each gateway plans replication from its own traffic, and without this three gateways warm one prefix three
times.

``sender`` is the gateway's instance id: a gateway that hears itself (its own address among the peers found by DNS)
ignores its own messages.

A hint is a prediction, never a holding: the receiver credits it as predicted, for what is left of the time-to-live
(``index.predicted_ttl_s``) since it was sent (the gateways' wall clocks, kept in step by NTP), and drops one that
is older, names a replica it does not have, or does not decode. A work report counts for ``work_ttl_s`` after it
was sent, never longer. PUB/SUB drops messages to a peer that is gone or slow, so losing peers only loses hints:
routing falls back to each gateway's own predictions and load.

Peers are the configured ``connect`` endpoints plus, with ``port`` and ``peers.dns``, every address of the gateways'
headless Service, re-resolved every ``resolve_interval_s`` with engine discovery's resolver (a failed resolution
keeps the last set; an address that left is disconnected).

Hints say which replica each request went to and when, so they are tenant traffic, and a received hint changes
routing: the exchange runs over CURVE (ZMQ's encryption and authentication) with one key pair every gateway derives
from the peer token. A publisher accepts only subscribers presenting that key, and a subscriber only publishers
holding it, so nobody without the token can read hints or inject them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.snapshot import pack_keys, unpack_keys
from kvgate.router.fleet.config import DiscoveryConfig, DiscoveryPorts
from kvgate.router.fleet.discovery.dns import DnsSource, ResolutionFailed
from kvgate.router.fleet.peer_work import MAX_REPORTED_REPLICAS, PeerWork
from kvgate.router.fleet.tickets import DispatchedWork
from kvgate.router.peers.config import PeersConfig

log = logging.getLogger(__name__)

HINT_FORMAT = 2
WORK_FORMAT = 4
WARMING_FORMAT = 5
MAX_PREFIX_KEY = (1 << 64) - 1
MAX_HINT_KEYS = 1 << 16
"""A prompt of a million tokens in 16-token blocks; more keys than this is no hint a gateway sends."""
MAX_SENDER_CHARS = 64
SEND_HWM = 10_000
"""Hints queued for a slow peer before new ones are dropped (PUB's high-water mark)."""
WORK_INTERVAL_S = 0.05
"""How often a gateway looks at its dispatched prefill work and publishes it when it changed."""
WORK_MIN_GAP_S = 0.005
"""A dispatch publishes the work at once, but no sooner than this after the previous report: a burst of
dispatches costs a report per gap, not one each."""
MAX_HEARD_SENDERS = 256
"""Peers whose last message time is kept (the longest silent is forgotten first): more gateways than a fleet runs."""
ZAP_DOMAIN = "kvgate-hints"
_KEY_LABEL = b"kvgate peer hints curve key"


def curve_keys(peer_token: str) -> tuple[bytes, bytes]:
    """The (public, secret) CURVE key pair, Z85-encoded, that every gateway holding ``peer_token`` derives alike."""
    secret = z85.encode(hmac.new(peer_token.encode(), _KEY_LABEL, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


class _OnlyPeers:
    """ZAP credentials check: a subscriber must present the peers' public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


class Hint(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=HINT_FORMAT):
    """A prompt a peer just routed: its block keys, predicted on ``replica``."""

    sent_at: float
    """Wall-clock seconds when the sending gateway routed the prompt."""
    sender: str
    replica: str
    keys: bytes


class Work(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=WORK_FORMAT):
    """A peer's dispatched work: per replica, uncached prompt tokens and requests still prefilling, and the
    requests per second it sends there."""

    sent_at: float
    sender: str
    loads: list[tuple[str, int, int, float]]


class Warming(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=WARMING_FORMAT):
    """A peer started warming ``target`` with the hot prefix whose last block's chain key is ``prefix_key``."""

    sent_at: float
    sender: str
    target: str
    prefix_key: int


@dataclass(slots=True)
class HintStats:
    published: int = 0
    applied: int = 0
    dropped: int = 0
    """Received and not credited: malformed, too old, an unknown replica."""
    work_published: int = 0
    work_applied: int = 0
    work_dropped: int = 0


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Hint | Work | Warming).decode
OwnWork = Callable[[], dict[str, DispatchedWork]]
"""This gateway's dispatched work, per replica it is prefilling on or lately sends requests to."""


class HintExchange:
    """Publishes this gateway's predictions and prefill work and takes in its peers' (see the module docstring)."""

    def __init__(
        self, config: PeersConfig, index: PrefixIndex, known: Callable[[str], bool], peer_token: str | None,
        sender: str, own_work: OwnWork = dict, clock: Callable[[], float] = time.time,
    ) -> None:
        self.peers = config
        self.config = config.hints
        self.index = index
        self.known = known
        self.sender = sender[:MAX_SENDER_CHARS]
        self.own_work = own_work
        self.clock = clock
        self.stats = HintStats()
        self.work = PeerWork(self.config.work_ttl_s, clock)
        self._keys = curve_keys(peer_token) if peer_token else None
        self._context: zmq.asyncio.Context | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._resolved: set[str] = set()
        """Peers' endpoints found by DNS that the subscriber is connected to."""
        self._tasks: list[asyncio.Task[None]] = []
        self.on_peer_warming: Callable[[int, str], None] | None = None
        """Told of each warm-up a peer started (prefix key, target): replication plans none of that prefix."""
        self._dispatched = asyncio.Event()
        """Set by :meth:`publish`: the work just grew, report it now rather than at the next tick."""
        self._heard: dict[str, float] = {}
        """When each peer's last message was taken in (this gateway's clock), the longest silent first."""

    @property
    def follows_dns(self) -> bool:
        return bool(self.config.port is not None and self.peers.dns.name)

    def start(self) -> None:
        """Bind the publisher and subscribe to the peers. The configuration check has made sure a peer token is
        set whenever hints are on."""
        if not (self.config.bind or self.config.connect or self.follows_dns):
            return
        if self._keys is None:
            raise ValueError("peers.hints needs server.peer_token (or the admin token)")
        public, secret = self._keys
        self._context = zmq.asyncio.Context()
        loop = asyncio.get_running_loop()
        if self.config.bind:
            self._auth = AsyncioAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OnlyPeers(public))
            pub = self._context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, SEND_HWM)
            pub.curve_server = True
            pub.curve_secretkey = secret
            pub.zap_domain = ZAP_DOMAIN.encode()
            pub.bind(self.config.bind)
            self._pub = pub
            if self.config.work_ttl_s > 0:
                self._tasks.append(loop.create_task(self._share_work(), name="peer-work"))
        if self.config.connect or self.follows_dns:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.curve_serverkey = public
            sub.curve_publickey = public
            sub.curve_secretkey = secret
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            for endpoint in self.config.connect:
                sub.connect(endpoint)
            self._sub = sub
            self._tasks.append(loop.create_task(self._receive(sub), name="peer-hints"))
            if self.follows_dns:
                self._tasks.append(loop.create_task(self._follow_dns(), name="peer-hints-dns"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(0)
        self._pub = self._sub = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
            # The authenticator's cancelled poll must leave the event loop before its socket's descriptor is freed:
            # left registered, it takes the events of the next socket given that number, and the next exchange's
            # authenticator (a reload's) never answers a handshake.
            await asyncio.sleep(0)
        if self._context is not None:
            self._context.destroy(0)
            self._context = None

    def publish(self, replica: str, keys: Sequence[int]) -> None:
        """This gateway just routed a prompt with these block keys to ``replica``; never blocks."""
        if self._pub is None or not keys or len(keys) > MAX_HINT_KEYS:
            return
        if self._send(Hint(self.clock(), self.sender, replica, pack_keys(keys))):
            self.stats.published += 1
        self._dispatched.set()

    def publish_warming(self, prefix_key: int, target: str) -> None:
        """This gateway just started warming ``target`` with a hot prefix; never blocks."""
        if self._pub is not None and 0 <= prefix_key <= MAX_PREFIX_KEY \
                and self._send(Warming(self.clock(), self.sender, target, prefix_key)):
            self.stats.published += 1

    def apply(self, message: bytes) -> bool:
        """Take in one received message; False when it is dropped (or is this gateway's own)."""
        try:
            decoded: Hint | Work | Warming | None = _decode(message)
        except (msgspec.DecodeError, msgspec.ValidationError):
            decoded = None
        if isinstance(decoded, Work):
            applied = self._apply_work(decoded)
        elif isinstance(decoded, Warming):
            applied = self._apply_warming(decoded)
        else:
            applied = self._apply_hint(decoded)
        if applied and decoded is not None:
            self._heard_from(decoded.sender[:MAX_SENDER_CHARS])
        return applied

    def _apply_hint(self, hint: Hint | None) -> bool:
        if hint is not None and hint.sender == self.sender:
            return False
        if hint is None or len(hint.keys) % 8 or not hint.keys or len(hint.keys) > 8 * MAX_HINT_KEYS \
                or not self.known(hint.replica):
            self.stats.dropped += 1
            return False
        left = self.index.predicted_ttl_s - (self.clock() - hint.sent_at)
        if not left > 0 or hint.sent_at > self.clock() + self.index.predicted_ttl_s:  # too old, or from the future
            self.stats.dropped += 1
            return False
        self.index.predict(hint.replica, unpack_keys(hint.keys), ttl_s=left)
        self.stats.applied += 1
        return True

    def _heard_from(self, sender: str) -> None:
        heard = self._heard
        heard.pop(sender, None)
        heard[sender] = self.clock()
        if len(heard) > MAX_HEARD_SENDERS:
            del heard[next(iter(heard))]

    def heard(self, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` peers this gateway took a message from, the most recently heard first, with the seconds
        since (as long as :data:`MAX_HEARD_SENDERS` are remembered)."""
        now = self.clock()
        return [(sender, now - at) for sender, at in itertools.islice(reversed(self._heard.items()), limit)]

    def heard_total(self) -> int:
        return len(self._heard)

    def subscribed(self) -> list[str]:
        """The peers' endpoints this gateway subscribes to: the configured ones and those found by DNS."""
        if self._sub is None:
            return []
        return sorted(set(self.config.connect) | self._resolved)

    def _apply_warming(self, warming: Warming) -> bool:
        if warming.sender == self.sender:
            return False
        age = self.clock() - warming.sent_at
        if not (0 <= warming.prefix_key <= MAX_PREFIX_KEY and self.known(warming.target)
                and -self.index.predicted_ttl_s < age < self.index.predicted_ttl_s):
            self.stats.dropped += 1
            return False
        if self.on_peer_warming is not None:
            self.on_peer_warming(warming.prefix_key, warming.target)
        self.stats.applied += 1
        return True

    def _apply_work(self, work: Work) -> bool:
        if work.sender == self.sender:
            return False
        if self.config.work_ttl_s <= 0 or len(work.sender) > MAX_SENDER_CHARS \
                or len(work.loads) > MAX_REPORTED_REPLICAS:
            self.stats.work_dropped += 1
            return False
        loads = {replica: DispatchedWork(tokens, prefilling, rate)
                 for replica, tokens, prefilling, rate in work.loads if self.known(replica)}
        if not self.work.update(work.sender, work.sent_at, loads):
            self.stats.work_dropped += 1
            return False
        self.stats.work_applied += 1
        return True

    def _send(self, message: Hint | Work | Warming) -> bool:
        if self._pub is None:
            return False
        try:
            self._pub.send(_encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _share_work(self) -> None:
        """Publish this gateway's work when its prefill changed, and again every third of the time-to-live while
        there is any, so peers never hold a report past it (and its rates are never older than that).

        A dispatch wakes it at once (:meth:`publish`, called as the request is sent: the work counts it by the time
        this task runs). Two gateways that each place a long cold prompt on the replica they both see idle, a few
        milliseconds apart, is the race this closes: the tick alone leaves it open for up to ``WORK_INTERVAL_S``."""
        last: dict[str, tuple[int, int]] = {}
        """The prefill part of the last report: rates change at every tick, prefill only at dispatches and first
        tokens."""
        last_sent = float("-inf")
        last_checked = float("-inf")
        refresh_s = self.config.work_ttl_s / 3
        while True:
            try:
                await asyncio.wait_for(self._dispatched.wait(), WORK_INTERVAL_S)
                await asyncio.sleep(WORK_MIN_GAP_S - (time.monotonic() - last_checked))
            except asyncio.TimeoutError:
                pass
            self._dispatched.clear()
            last_checked = time.monotonic()
            work = self.own_work()
            prefill = {replica: (w.prefill_tokens, w.prefilling) for replica, w in work.items() if w.prefilling}
            now = self.clock()
            if prefill == last and not (work and now - last_sent >= refresh_s):
                continue
            loads = [(replica, w.prefill_tokens, w.prefilling, round(w.arrival_rate_per_s, 4))
                     for replica, w in work.items()]
            if self._send(Work(now, self.sender, loads)):
                self.stats.work_published += 1
                last, last_sent = prefill, now

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            if len(frames) == 1:
                self.apply(frames[0])
            else:
                self.stats.dropped += 1

    async def _follow_dns(self) -> None:
        """Subscribe to every address the gateways' headless Service lists, as it changes."""
        peers = self.peers
        ports = DiscoveryPorts(http=peers.port, kv_events=self.config.port, kv_replay=None)
        source = DnsSource(DiscoveryConfig(kind="dns", dns=peers.dns, ports=ports, scheme=peers.scheme))
        while True:
            try:
                targets = await source.resolve()
            except ResolutionFailed as e:
                log.warning("peer hints: resolving %s failed, keeping the last answer: %s", peers.dns.name, e)
            else:
                self.follow({t.config.kv_events for t in targets.values() if t.config.kv_events})
            await asyncio.sleep(self.config.resolve_interval_s)

    def follow(self, endpoints: set[str]) -> None:
        """Be subscribed to exactly these DNS-found endpoints (besides the configured ones)."""
        sub = self._sub
        if sub is None:
            return
        static = set(self.config.connect)
        for endpoint in sorted(endpoints - self._resolved - static):
            log.info("peer hints: subscribing to %s", endpoint)
            sub.connect(endpoint)
        for endpoint in sorted(self._resolved - endpoints - static):
            log.info("peer hints: %s left", endpoint)
            try:
                sub.disconnect(endpoint)
            except zmq.ZMQError:
                pass
        self._resolved = endpoints - static
