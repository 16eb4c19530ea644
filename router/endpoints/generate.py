"""Generation: every API whose prompt kvgate routes (chat completions, completions, Anthropic Messages), as one
flow: admit → parse → tokenize → queue → route → forward → relay → account. A refusal is answered in the API's
own error shape.

A long prompt new to the gateway is routed on its beginning while its rest is tokenized, when the beginning settles
where every replica's cached prefix ends (:meth:`~kvgate.router.pipeline.route.RouteStage.route_lead`): its
tokenizing is then off the time to its first token."""

from __future__ import annotations

from starlette.responses import Response

from kvgate.router.apis.base import Api
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest, StreamedAnswer
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.admission.gate import Ticket
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.queue import QueueStage
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage


class Generate:
    def __init__(self, proxied: ProxiedRequests, tokenize: TokenizeStage, queue: QueueStage, route: RouteStage) -> None:
        self.proxied = proxied
        self.tokenize = tokenize
        self.queue = queue
        self.route = route

    async def __call__(self, request: HttpRequest, api: Api) -> Response | StreamedAnswer:
        admission = Admission.of(request)
        ticket: Ticket | None = None
        try:
            admitted = await self.proxied.admit(request, api, admission)
            prompt = await self.tokenize.tokenize(admitted.parsed, trace=admission.trace, lead=True)
            ticket = await self.queue.wait(request, prompt, admitted.parsed, admission)
            if ticket is None:
                return self.proxied.left_waiting(admission, api)
            routed = await self.route.route_tokenized(
                prompt, admission, admitted.parsed.stream, lambda lead: self.tokenize.whole(lead, api.prompt_param))
        except BaseException as err:
            if ticket is not None:
                ticket.release()
            if isinstance(err, ApiError):
                return self.proxied.refuse(err, admission, api)
            raise
        return await self.proxied.answer(request, api.path, admitted, routed, ticket=ticket)
