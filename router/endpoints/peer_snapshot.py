"""``GET /kvgate/v1/peer/snapshot``: this gateway's prefix index, for a peer that is starting (warm start,
:mod:`kvgate.router.peers.warm_start`): the peer or admin token only, never a tenant's key."""

from __future__ import annotations

from starlette.responses import Response

from kvgate.cache_index.ingest import EventIngestor
from kvgate.cache_index.subscriber import SubscriptionManager
from kvgate.router.core.errors import ApiError
from kvgate.router.endpoints.callers import Callers
from kvgate.router.fleet.state import Fleet
from kvgate.router.peers.snapshot import CONTENT_TYPE, take_snapshot
from kvgate.router.peers.warm_start import WarmStart
from kvgate.router.settings.holder import ConfigHolder


class PeerSnapshot:
    def __init__(
        self, holder: ConfigHolder, callers: Callers, fleet: Fleet, ingestor: EventIngestor,
        subscriptions: SubscriptionManager, warm_start: WarmStart,
    ) -> None:
        self.holder = holder
        self.callers = callers
        self.fleet = fleet
        self.ingestor = ingestor
        self.subscriptions = subscriptions
        self.warm_start = warm_start

    def __call__(self, authorization: str | None, instance: str | None) -> Response:
        self.callers.credentials.require_peer(authorization)
        if instance == self.warm_start.instance:
            raise ApiError(409, "This is the asking gateway itself.", code="same_instance")
        if self.warm_start.warming:
            raise ApiError(503, "Warming up from a peer; no snapshot yet.", code="warming")
        raw = take_snapshot(self.fleet, self.ingestor, self.subscriptions)
        if len(raw) > self.holder.current.peers.max_snapshot_bytes:
            raise ApiError(507, "The snapshot is larger than peers.max_snapshot_bytes.", code="snapshot_too_large")
        return Response(raw, media_type=CONTENT_TYPE)
