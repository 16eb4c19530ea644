"""Passthrough: requests with no prompt prefix to match (embeddings, rerank, scoring, pooling, tokenizing, audio
transcription), as one flow: admit → read the model → the least-loaded replica → forward → relay → account, the body
unchanged (multipart uploads included)."""

from __future__ import annotations

from starlette.responses import Response

from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest, StreamedAnswer
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.route import RouteStage

MODEL_OPTIONAL = frozenset({"/tokenize", "/detokenize"})
"""Paths whose engine takes its own model when the body names none."""


class Passthrough:
    def __init__(self, proxied: ProxiedRequests, route: RouteStage) -> None:
        self.proxied = proxied
        self.route = route

    async def __call__(self, request: HttpRequest, path: str) -> Response | StreamedAnswer:
        admission = Admission.of(request)
        try:
            admitted = await self.proxied.admit_forwarded(request, admission, model_optional=path in MODEL_OPTIONAL)
            routed = self.route.route_least_loaded(admitted.parsed.model, admission)
        except ApiError as e:
            return self.proxied.refuse(e, admission, None)
        return await self.proxied.answer(request, path, admitted, routed)
