"""Passthrough: requests with no prompt prefix to match (embeddings), as one flow: admit → parse → the least-loaded
replica → forward → relay → account, the body unchanged."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from kvgate.router.core.errors import ApiError
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.pipeline.route import RouteStage


class Passthrough:
    def __init__(self, proxied: ProxiedRequests, route: RouteStage) -> None:
        self.proxied = proxied
        self.route = route

    async def __call__(self, request: Request, path: str) -> Response:
        admitted = await self.proxied.admit(request, None)
        try:
            routed = self.route.route_least_loaded(admitted.parsed.model, admitted.admission)
        except ApiError as e:
            raise self.proxied.refused(admitted, e) from None
        return await self.proxied.answer(request, path, admitted, routed)
