"""Counting tokens (``POST /v1/messages/count_tokens``): admit → parse → tokenize → the least-loaded replica →
forward → relay → account. The engine answers with its own count; kvgate tokenizes the body too, so every count
is a parity sample (:mod:`kvgate.router.routing.parity`), and nothing is generated, so nothing is worth routing
for its cache."""

from __future__ import annotations

from starlette.responses import Response

from kvgate.router.apis.anthropic import COUNT_TOKENS
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest, StreamedAnswer
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage


class CountTokens:
    def __init__(self, proxied: ProxiedRequests, tokenize: TokenizeStage, route: RouteStage) -> None:
        self.proxied = proxied
        self.tokenize = tokenize
        self.route = route

    async def __call__(self, request: HttpRequest) -> Response | StreamedAnswer:
        api = COUNT_TOKENS
        admission = Admission.of(request)
        try:
            admitted = await self.proxied.admit(request, api, admission)
            prompt = await self.tokenize.tokenize(admitted.parsed, trace=admission.trace)
            routed = self.route.route_counted(prompt, admission)
        except ApiError as e:
            return self.proxied.refuse(e, admission, api)
        return await self.proxied.answer(request, api.path, admitted, routed)
