"""SGLang's handoff: the prefill and the decode leg sent at once, met through a bootstrap room.

Both legs carry ``bootstrap_host`` (the prefill replica's host), ``bootstrap_port`` (its bootstrap server's port, from
the replica's config) and the same fresh ``bootstrap_room`` (random in [0, 2^63 - 1], as SGLang's routers draw it).
The decode server finds the prefill through the bootstrap server, waits for the room's KV and answers the client's
request (streamed as asked); the prefill leg is sent not streamed and its answer (one token) is read to its end in
the background and dropped, as sglang-router does.

Unlike sglang-router, kvgate watches the prefill leg: when it fails or times out before the decode's first byte, the
decode leg is cancelled (closing its connection aborts it) and the decode replica prefills locally, rather than leave
the client waiting for SGLang's own bound on the wait (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s by default;
the decode leg's first-byte deadline bounds it here). A decode leg that fails before its first byte is a local
prefill too: on the decode replica itself when it answered (its 500 ``KVTransferError``, a stream opening with an
error event: the server is up, only the handoff failed), else on the next ranked replica, as every handoff's is
(:mod:`kvgate.router.routing.handoff.base`). See docs/disaggregation.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvgate.policies.config import TransferConfig
from kvgate.router.apis.base import Api
from kvgate.router.fleet.attempts import Attempts, Upstream
from kvgate.router.routing.handoff.base import HandoffRequest, Send
from kvgate.router.routing.transfers import TransferRunner, kind_of
from kvgate.router.upstream.proxy import AttemptFailed, Forward

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode

ROOM_MAX = 2**63 - 1
ERROR_EVENT = b'data: {"error"'
"""How an SGLang stream opens when its request failed after the 200 went out (a failed KV transfer)."""
_ROOMS = random.SystemRandom()


def new_room(rng: random.Random | None = None) -> int:
    """A fresh bootstrap room, uniform in [0, 2^63 - 1]: two handoffs in flight never share one."""
    return (rng or _ROOMS).getrandbits(63)


def bootstrap_host(url: str) -> str:
    """The host of a replica's URL: where the decode server reaches the prefill's bootstrap server (an IPv6 address
    without brackets; SGLang joins host and port itself)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    return host


@dataclass(frozen=True, slots=True)
class Room:
    """One handoff's three fields, the same on both legs."""

    host: str
    port: int
    room: int

    def fields(self) -> dict[str, Any]:
        return {"bootstrap_host": self.host, "bootstrap_port": self.port, "bootstrap_room": self.room}


def decode_leg_body(body: dict[str, Any], room: Room) -> dict[str, Any]:
    """The client's request as the decode server gets it: unchanged but for the room's fields."""
    return {**body, **room.fields()}


def prefill_leg_body(api: Api, body: dict[str, Any], room: Room) -> dict[str, Any]:
    """The prefill server's copy: the room's fields, not streamed (its answer is dropped, so it is read whole)."""
    return {**api.not_streamed(body), **room.fields()}


class SglangHandoff:
    def __init__(self, attempts: Attempts, transfers: TransferRunner, config: TransferConfig) -> None:
        self.attempts = attempts
        self.transfers = transfers
        self.config = config
        self._draining: set[asyncio.Future[Upstream]] = set()
        """Prefill legs still being read after their decode leg answered."""

    def reconfigure(self, config: TransferConfig) -> None:
        self.config = config

    async def run(self, request: HandoffRequest, send: Send) -> Upstream:
        routed = request.routed
        decision = routed.decision
        assert decision.source is not None
        local = [decision.replica, *request.retries]
        prefill = self.attempts.fleet.replicas.get(decision.source)
        port = prefill.config.bootstrap_port if prefill is not None else None
        if prefill is None or port is None:
            # A warm transfer's source that is no SGLang prefill server: SGLang moves KV only out of those.
            return await send(request.raw, local)
        room = Room(bootstrap_host(prefill.url), port, new_room())
        kind = kind_of(routed)
        metrics = self.transfers.metrics
        metrics.transfers[kind, "started"].inc()
        began = time.monotonic()
        timeout_s = self.config.first_leg_timeout_s
        prefill_fwd = Forward(request.api.path, _encode(prefill_leg_body(request.api, request.body, room)),
                              request.headers, False, [decision.source], 1, {decision.source: timeout_s},
                              trace=request.trace)
        leg = self.attempts.forward(prefill_fwd, request.load_on(decision.source))
        prefill_leg = asyncio.ensure_future(_within(leg, timeout_s))
        decode_leg = asyncio.ensure_future(send(_encode(decode_leg_body(request.body, room)), [decision.replica]))
        try:
            done, _ = await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if decode_leg not in done and not _succeeded(_answer(prefill_leg)):
                decode_leg.cancel()
            await asyncio.wait({decode_leg})
        except asyncio.CancelledError:  # the client left: neither leg is of use now
            decode_leg.cancel()
            prefill_leg.cancel()
            raise
        finally:
            self._drain(prefill_leg)
        up = _answer(decode_leg)
        if _succeeded(up):
            assert up is not None
            metrics.transfer_seconds[kind, "completed"].observe(time.monotonic() - began)
            self.transfers.finished_for(routed, ok=True)
            return up
        prefill_leg.cancel()
        if decode_leg.cancelled():
            log.warning("prefill leg on %s failed (room %d): prefilling on %s", decision.source, room.room,
                        decision.replica)
            metrics.transfers[kind, "fallback"].inc()
            metrics.transfer_seconds[kind, "fallback"].observe(time.monotonic() - began)
            return await send(request.raw, local)
        failed = decode_leg.exception()
        self.transfers.finished_for(routed, ok=False)
        if up is not None and up.status != 200 and up.status < 500:
            return up  # the client's own error (a 4xx): a local prefill would answer the same
        if up is not None:
            up.response.close()
            up.ticket.finish(None)  # the decode server is up and answered: only the handoff failed
        if up is not None or (isinstance(failed, AttemptFailed) and failed.status is not None):
            log.warning("decode leg on %s answered without its KV (room %d): prefilling there", decision.replica,
                        room.room)
            return await send(request.raw, local)  # the decode server is up; only the handoff failed
        if not request.retries:
            assert failed is not None
            raise failed
        log.warning("decode leg on %s failed before its first byte (room %d): prefilling on %s", decision.replica,
                    room.room, request.retries[0])
        return await send(request.raw, request.retries)

    def _drain(self, prefill_leg: asyncio.Future[Upstream]) -> None:
        """Release the prefill leg's load ticket and connection whenever it ends; its answer is never used."""

        def done(task: asyncio.Future[Upstream]) -> None:
            self._draining.discard(task)
            up = _answer(task)
            if up is not None:
                up.settle()
                up.response.release()

        if prefill_leg.done():
            done(prefill_leg)
            return
        self._draining.add(prefill_leg)
        prefill_leg.add_done_callback(done)


async def _within(forward: Any, timeout_s: float) -> Upstream:
    """The prefill leg bounded as a whole (its answer is read whole: the prefill and one token)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await forward
    except TimeoutError:
        raise AttemptFailed("timeout", f"prefill leg took more than {timeout_s:.1f} s") from None


def _answer(leg: asyncio.Future[Upstream]) -> Upstream | None:
    """A finished leg's answer; None when it raised (its attempt failed) or was cancelled."""
    if not leg.done() or leg.cancelled() or leg.exception() is not None:
        return None
    return leg.result()


def _succeeded(up: Upstream | None) -> bool:
    """An answer that is a 200 and not a stream opening with an error event."""
    return up is not None and up.status == 200 and not up.body.lstrip().startswith(ERROR_EVENT)
