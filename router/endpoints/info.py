"""What the gateway tells about itself: ``GET /v1/models``, ``/health``, ``/ready`` and ``/metrics``, each showing a
caller only what it may see."""

from __future__ import annotations

from typing import Any

from kvgate.router.core.errors import ApiError
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.endpoints.callers import Callers
from kvgate.router.fleet.state import Fleet
from kvgate.router.peers.warm_start import WarmStart
from kvgate.router.pipeline.admit import ClientHeaders


class Info:
    def __init__(self, callers: Callers, fleet: Fleet, warm_start: WarmStart, metrics: GatewayMetrics) -> None:
        self.callers = callers
        self.fleet = fleet
        self.warm_start = warm_start
        self.metrics = metrics

    def models(self, client: ClientHeaders) -> dict[str, Any]:
        """``/v1/models`` as the caller may see it: the admin every model as the engines list them; anyone else only
        the models and adapters its tenant may use, without the engines' filesystem paths (``root``)."""
        tenant, admin = self.callers.require_caller(client)
        models = self.fleet.models()
        if not admin:
            may_use = self.callers.may_use(tenant)
            models = [{k: v for k, v in m.items() if k != "root"} for m in models if may_use(m["id"])]
        return {"object": "list", "data": models}

    def ready(self, client: ClientHeaders) -> dict[str, Any]:
        """Open to probes: ready while a replica passes its health checks (open circuits are transient ejections,
        and a client's failures must not unready the gateway); the routable replicas' names only to callers who may
        send requests."""
        if self.warm_start.warming:
            raise ApiError(503, "warming up from a peer's index snapshot", code="warming")
        serving = self.fleet.serving()
        if not serving:
            raise ApiError(503, "no replica passes its health checks", code="no_replica")
        if not self.callers.may_call(client):
            return {"status": "ready"}
        return {"status": "ready", "routable": [r.name for r in serving if r.routable()]}

    def metrics_text(self, authorization: str | None) -> bytes:
        self.callers.credentials.require_metrics(authorization)
        return self.metrics.render()
