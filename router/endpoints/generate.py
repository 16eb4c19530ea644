"""Generation: every API whose prompt kvgate routes (chat completions, completions, Anthropic Messages), as one flow:
admit → parse → tokenize → route → forward → relay → account. A refusal is answered in the API's own error shape."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from kvgate.router.apis.base import Api
from kvgate.router.core.errors import ApiError
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage


class Generate:
    def __init__(self, proxied: ProxiedRequests, tokenize: TokenizeStage, route: RouteStage) -> None:
        self.proxied = proxied
        self.tokenize = tokenize
        self.route = route

    async def __call__(self, request: Request, api: Api) -> Response:
        admission = Admission.of(request.scope)
        try:
            admitted = await self.proxied.admit(request, api, admission)
            prompt = await self.tokenize.tokenize(admitted.parsed)
            routed = self.route.route(prompt, admission, admitted.parsed.stream)
        except ApiError as e:
            return self.proxied.refuse(e, admission, api)
        return await self.proxied.answer(request, api.path, admitted, routed)
