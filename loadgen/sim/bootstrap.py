"""SGLang's prefill/decode handoff on the simulated fleet: bootstrap host, port and room.

An SGLang P/D router sends the same request to a prefill server and a decode server at once, both carrying
``bootstrap_host`` and ``bootstrap_port`` (the prefill server's bootstrap server) and a ``bootstrap_room`` (a random
integer in [0, 2^63 - 1] naming this one handoff). The prefill server computes the prompt and offers the room's KV;
the decode server asks the bootstrap server where the prefill is (``GET /route``), waits for the room's KV, pulls it
and decodes. The decode waits a bounded time (SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``); when the KV never
comes it fails the request with a 500.

Here a replica with ``--bootstrap-port`` runs a real bootstrap listener (``/health``, ``/route``). A request whose
fields name this replica's own bootstrap port is the prefill leg: one token, its blocks leased when it finishes
(the engine's NixlConnector lease, the same blocks and the same link cost) and the room offered. Any other request
carrying the fields is a decode leg: it resolves the prefill over HTTP (once per bootstrap address, as SGLang caches
it), waits for the room on that replica's table, then pulls the leased blocks like a ``do_remote_prefill`` request.
Two simplifications, both stated in docs/sim.md: the decode leg reserves no KV while it waits, and its answer (headers
included) goes out only once the KV has arrived or the wait failed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import msgspec
from aiohttp import web

from .engine import RemoteSource, SimRequest, State
from .errors import EngineError
from .replica import SimReplica

log = logging.getLogger(__name__)

ROOM_MAX = 2**63 - 1
"""Rooms are drawn from [0, 2^63 - 1] (SGLang's ``random.randint(0, 2**63 - 1)``; sglang-router masks a u64)."""
ROUTE_TIMEOUT_S = 5.0
"""How long a decode leg waits for the bootstrap server's ``/route`` answer."""


@dataclass(frozen=True, slots=True)
class BootstrapFields:
    """A request's ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_fields(body: dict[str, Any]) -> BootstrapFields | None:
    """The bootstrap fields of a request body, or None when it carries none. All three or none: a request with only
    some of them, lists (SGLang's batch form; the sim serves one prompt per request) or a room out of range is a
    400."""
    values = [body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")]
    if all(v is None for v in values):
        return None
    host, port, room = values
    if not isinstance(host, str) or not host:
        raise EngineError("bootstrap_host must be a non-empty string", "bootstrap_host")
    if type(port) is not int or not 0 < port < 65536:
        raise EngineError("bootstrap_port must be a port number", "bootstrap_port")
    if type(room) is not int or not 0 <= room <= ROOM_MAX:
        raise EngineError(f"bootstrap_room must be an integer in [0, {ROOM_MAX}]", "bootstrap_room")
    return BootstrapFields(host, port, room)


@dataclass(slots=True)
class Offer:
    """A room whose KV a prefill replica holds: the engine lease a decode pulls (engine id, request id)."""

    source: RemoteSource | None
    """None: the prefill leg failed, and the room with it."""
    expiry: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class RoomTable:
    """One prefill replica's rooms: offered KV waiting for its decode, and decodes waiting for their KV. Entries
    live at most ``hold_s`` (the engine's lease time) whichever side comes first, so the table stays bounded."""

    hold_s: float
    offers: dict[int, Offer] = field(default_factory=dict)
    waiters: dict[int, asyncio.Future[RemoteSource | None]] = field(default_factory=dict)
    expired: int = 0

    def offer(self, room: int, source: RemoteSource | None) -> None:
        """The prefill leg of ``room`` ended: its KV is at ``source`` (None: it failed). A decode already waiting
        takes it at once; otherwise it is kept for ``hold_s``. A room offered twice keeps its first offer."""
        waiter = self.waiters.pop(room, None)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(source)
            return
        if room in self.offers:
            return
        offer = Offer(source)
        offer.expiry = asyncio.get_running_loop().call_later(self.hold_s, self._expire, room, offer)
        self.offers[room] = offer

    async def take(self, room: int, timeout_s: float) -> RemoteSource | None:
        """Wait up to ``timeout_s`` for ``room``'s KV: where it is, or None when it failed or never came. A second
        decode of the same room gets None (a room names one handoff)."""
        offer = self.offers.pop(room, None)
        if offer is not None:
            if offer.expiry is not None:
                offer.expiry.cancel()
            return offer.source
        if room in self.waiters:
            return None
        waiter: asyncio.Future[RemoteSource | None] = asyncio.get_running_loop().create_future()
        self.waiters[room] = waiter
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return None
        finally:
            if self.waiters.get(room) is waiter:
                del self.waiters[room]

    def clear(self) -> None:
        """The prefill engine restarted: every offered room is gone and every waiting decode fails now."""
        for offer in self.offers.values():
            if offer.expiry is not None:
                offer.expiry.cancel()
        self.offers.clear()
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    def _expire(self, room: int, offer: Offer) -> None:
        if self.offers.get(room) is offer:
            del self.offers[room]
            self.expired += 1


@dataclass(slots=True)
class BootstrapStats:
    rooms_served: int = 0
    """Prefill legs that finished and offered their room's KV."""
    rooms_pulled: int = 0
    """Decode legs that found their room's KV and went on to pull it."""
    rooms_failed: int = 0
    """Decode legs that failed: the prefill unreachable, failed, or too slow (the waiting timeout)."""
    route_lookups: int = 0
    """``GET /route`` calls made to a bootstrap server (once per bootstrap address and decode replica)."""


class ReplicaBootstrap:
    """One replica's side of SGLang's handoff: its bootstrap listener and room table (prefill legs), and the
    bootstrap addresses it has resolved (decode legs). ``find_peer`` finds the bootstrap side of the fleet's replica
    of that name (this one included), None when there is none: a ``/route`` answer names the replica it came from."""

    def __init__(
        self, replica: SimReplica, port: int | None, find_peer: Callable[[str], ReplicaBootstrap | None]
    ) -> None:
        self.replica = replica
        self.port = port
        self._find_peer = find_peer
        self.rooms = RoomTable(replica.params.transfer_lease_s)
        self.stats = BootstrapStats()
        self._resolved: dict[str, RoomTable] = {}
        self._session: aiohttp.ClientSession | None = None
        self._web_server: web.Server | None = None
        self._listener: asyncio.base_events.Server | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.port is None or self._listener is not None:
            return
        self._web_server = web.Server(self._handle, access_log=None)
        self._listener = await asyncio.get_running_loop().create_server(
            self._web_server, self.replica.host, self.port, reuse_address=True
        )

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            await self._listener.wait_closed()
            self._listener = None
        if self._web_server is not None:
            await self._web_server.shutdown()
            self._web_server = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.rooms.clear()

    def restart(self) -> None:
        """The engine restarted: its leased KV is gone, so are its rooms."""
        self.rooms.clear()

    def summary(self) -> dict[str, Any]:
        s = self.stats
        return {"port": self.port, "rooms_served": s.rooms_served, "rooms_pulled": s.rooms_pulled,
                "rooms_failed": s.rooms_failed, "rooms_expired": self.rooms.expired,
                "rooms_offered": len(self.rooms.offers), "rooms_waiting": len(self.rooms.waiters),
                "route_lookups": s.route_lookups}

    # --- the two legs --------------------------------------------------------------------------------------------
    def is_prefill_leg(self, fields: BootstrapFields) -> bool:
        """The fields name this replica's own bootstrap server (SGLang's prefill reads only the room; the host is
        whatever name the router gave it)."""
        return self.port is not None and fields.port == self.port

    def settle(self, fields: BootstrapFields, req: SimRequest) -> None:
        """A prefill leg ended: offer its room's KV (the engine leased its blocks), or fail the room."""
        leased = req.state is State.COMPLETED and req.request_id in self.replica.engine.leases
        source = RemoteSource(self.replica.engine.engine_id, req.request_id) if leased else None
        if source is not None:
            self.stats.rooms_served += 1
        self.rooms.offer(fields.room, source)

    async def await_kv(self, fields: BootstrapFields) -> RemoteSource:
        """A decode leg: where its room's KV is, once the prefill offered it. Raises the 500 SGLang's decode
        answers when the bootstrap server cannot be reached, the prefill failed, or the wait runs out."""
        table = await self._resolve(fields)
        source = await table.take(fields.room, self.replica.params.transfer_lease_s) if table is not None else None
        if source is None:
            self.stats.rooms_failed += 1
            reason = ("the bootstrap server did not answer" if table is None
                      else f"Request {fields.room} timed out or its prefill failed in KVPoll.WaitingForInput")
            raise EngineError(
                f"Decode transfer failed for request rank=0 bootstrap_room={fields.room} with exception "
                f"KVTransferError(bootstrap_room={fields.room}): {reason}", None, 500, "InternalServerError")
        self.stats.rooms_pulled += 1
        return source

    async def _resolve(self, fields: BootstrapFields) -> RoomTable | None:
        """The room table behind a bootstrap address: asked of that server once (``GET /route``, as SGLang's
        decode fetches the prefill's rank info), then cached. None if it does not answer or is not in this fleet."""
        table = self._resolved.get(fields.address)
        if table is not None:
            return table
        self.stats.route_lookups += 1
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ROUTE_TIMEOUT_S))
        url = f"http://{fields.address}/route"
        try:
            async with self._session.get(url, params={"engine_rank": "0", "target_dp_group": "0"}) as resp:
                info = msgspec.json.decode(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
            log.warning("bootstrap server %s: %s", fields.address, e)
            return None
        name = info.get("sim_replica") if isinstance(info, dict) else None
        peer = self._find_peer(name) if isinstance(name, str) else None
        if peer is None:
            return None
        self._resolved[fields.address] = peer.rooms
        return peer.rooms

    # --- the bootstrap listener ----------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/health":
            return web.Response(text="OK")
        if request.method == "GET" and request.path == "/route":
            return web.json_response({
                "rank_ip": self.replica.host, "rank_port": self.port, "sim_replica": self.replica.name,
                "engine_id": self.replica.engine.engine_id, "page_size": self.replica.params.block_size
            })
        return web.Response(status=404, text="Not Found")
