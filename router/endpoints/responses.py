"""OpenAI's Responses API: ``POST /v1/responses`` as the generation flow (admit → parse → tokenize → route → forward →
relay → account) with the response named by kvgate and, for a stored response's follow-up, sent to the replica that
holds it; and ``GET``, ``DELETE`` and ``POST …/cancel`` of ``/v1/responses/{id}``, sent to that replica.

A follow-up (``previous_response_id``) must reach the engine that stored the response it names. One that names an
id kvgate did not make for the caller's tenant is refused (404, as vLLM answers an id it does not know), one whose
replica left the fleet too, and one whose replica cannot take it now gets 503: a conversation cannot move. When
kvgate saw the response answered, it knows what the engine renders the follow-up after, and tokenizes it exactly;
otherwise the follow-up routes as an approximate request whose blocks are neither looked up nor predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Literal

import msgspec
from starlette.responses import Response

from kvgate.router.admission.gate import Ticket
from kvgate.router.apis.responses import RESPONSES, History, history_of, previous_response_id, responses_prompt
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest, StreamedAnswer
from kvgate.router.endpoints.proxied import ProxiedRequests
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.fleet.state import Fleet
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.errors import routing_errors
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.pipeline.relay import StreamResult
from kvgate.router.pipeline.queue import QueueStage
from kvgate.router.pipeline.route import RouteStage
from kvgate.router.pipeline.tokenize import TokenizeStage
from kvgate.router.prompts.prompt import ChatPrompt
from kvgate.router.routing.config import ResponsesConfig
from kvgate.router.routing.stored_responses import ResponseIds, StoredResponses, locate
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.upstream.client import EngineClient, UpstreamError

_encode = msgspec.json.Encoder().encode
Action = Literal["get", "cancel", "delete"]


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


class Responses:
    def __init__(
        self, holder: ConfigHolder, proxied: ProxiedRequests, tokenize: TokenizeStage, queue: QueueStage,
        route: RouteStage,
        fleet: Fleet, ids: ResponseIds, stored: StoredResponses, client: EngineClient,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.holder = holder
        self.proxied = proxied
        self.tokenize = tokenize
        self.queue = queue
        self.route = route
        self.fleet = fleet
        self.ids = ids
        self.stored = stored
        self.client = client
        self.spawn = spawn

    @property
    def config(self) -> ResponsesConfig:
        return self.holder.current.responses

    async def create(self, request: HttpRequest) -> Response | StreamedAnswer:
        api = RESPONSES
        admission = Admission.of(request)
        ticket: Ticket | None = None
        try:
            admitted = await self.proxied.admit(request, api, admission)
            parsed = admitted.parsed
            with routing_errors():
                previous = previous_response_id(parsed.body)
            pinned = history = None
            if previous is not None:
                pinned = await self._replica_of(previous, admission.tenant)
                history = self.stored.history_of(previous)
            response_id = self._name(parsed, admission.tenant)
            built: list[ChatPrompt] = []

            def prompt_of() -> ChatPrompt:
                built.append(responses_prompt(parsed.body, history))
                return built[-1]

            partial = previous is not None and history is None
            prompt = await self.tokenize.tokenize(parsed, prompt_of=prompt_of, pinned=pinned, partial=partial,
                                                  trace=admission.trace, lead=True)
            ticket = await self.queue.wait(request, prompt, parsed, admission)
            if ticket is None:
                return self.proxied.left_waiting(admission, api)
            routed = await self.route.route_tokenized(
                prompt, admission, parsed.stream, lambda lead: self.tokenize.whole(lead, api.prompt_param))
        except BaseException as err:
            if ticket is not None:
                ticket.release()
            if isinstance(err, ApiError):
                return self.proxied.refuse(err, admission, api)
            raise
        stores = parsed.body.get("store") is not False

        def answered(up: Upstream, result: StreamResult | None) -> None:
            if stores and up.status == 200 and (result is None or result.end == "ok"):
                # A partial conversation is no history: what comes after it would miss what came before.
                messages = built[-1].messages if built and not partial else None
                self._remember(response_id, up, result is not None, messages)

        return await self.proxied.answer(request, api.path, admitted, routed, answered=answered, ticket=ticket)

    def _name(self, parsed: Parsed, tenant: str | None) -> str:
        """kvgate's id for the response: the body's ``request_id``, which vLLM makes the response's id."""
        response_id = self.ids.mint(tenant)
        parsed.body["request_id"] = response_id
        parsed.raw = _encode(parsed.body)
        return response_id

    def _remember(self, response_id: str, up: Upstream, streamed: bool, messages: list[dict[str, Any]] | None) -> None:
        self.stored.record(response_id, up.replica)
        if messages is None:
            return
        if not streamed:
            history = history_of(messages, up.body)
            if history is not None:
                self.stored.keep_history(response_id, history)
        else:  # a stream's output is only whole in its last event: ask the engine for the stored response
            self.spawn(self._fetch_history(response_id, up.replica, messages))

    async def _fetch_history(self, response_id: str, replica: str, messages: list[dict[str, Any]]) -> None:
        found = self.fleet.replicas.get(replica)
        if found is None:
            return
        try:
            answer = await self.client.fetch("GET", f"{found.url}/v1/responses/{response_id}",
                                             timeout_s=self.config.lookup_timeout_s)
        except (UpstreamError, OSError, TimeoutError, ValueError):
            return
        body = answer.body if answer.status == 200 else None
        history: History | None = history_of(messages, body) if body is not None else None
        if history is not None:
            self.stored.keep_history(response_id, history)

    async def _replica_of(self, response_id: str, tenant: str | None) -> str:
        """The replica that stores ``response_id``, which must be ``tenant``'s and reachable now (ApiError if not)."""
        if not self.ids.valid(response_id, tenant):
            raise not_found(response_id)
        name = self.stored.replica_of(response_id)
        if name is None:
            replicas = [(r.name, r.url) for r in self.fleet.replicas.values() if r.healthy]
            name = await locate(self.client, response_id, replicas, self.config.lookup_timeout_s)
            if name is None:
                raise not_found(response_id)
            self.stored.record(response_id, name)
        replica = self.fleet.replicas.get(name)
        if replica is None:
            self.stored.forget(response_id)
            raise ApiError(404, f"Response '{response_id}' was stored by replica {name}, which has left the fleet: its "
                           "conversation is gone. Start a new one without previous_response_id.",
                           param="previous_response_id", code="response_replica_gone")
        if not replica.routable():
            raise ApiError(503, f"Response '{response_id}' is stored by replica {name}, which takes no requests now "
                           "(down, draining or failing); try again later.", param="previous_response_id",
                           code="response_replica_unavailable")
        return name

    async def by_id(self, request: HttpRequest, response_id: str, action: Action) -> Response | StreamedAnswer:
        """``GET`` (``?stream=true`` replays a background response), ``DELETE``, and ``POST …/cancel`` of a stored
        response, at the replica that stores it."""
        api = RESPONSES
        admission = Admission.of(request)
        try:
            admitted = await self.proxied.admit_bodiless(request, admission)
            replica = await self._replica_of(response_id, admission.tenant)
            routed = self.route.route_least_loaded("", admission, among=[replica])
            routed.prefills = False
        except ApiError as e:
            return self.proxied.refuse(e, admission, api)
        admitted.parsed.api = api
        admitted.parsed.stream = action == "get" and request.query_param("stream") == "true"
        path = request.path + (f"?{request.query}" if request.query else "")
        method = {"get": "GET", "delete": "DELETE", "cancel": "POST"}[action]
        response = await self.proxied.answer(request, path, admitted, routed, method=method)
        if action == "delete" and response.status_code == 405:
            # vLLM 0.32 has no DELETE route: the response stays in that engine until it restarts.
            return ApiError(501, f"Response '{response_id}' cannot be deleted: its engine does not support deleting "
                            "stored responses, so it keeps it until it restarts.", param="response_id",
                            code="delete_unsupported").response(response.headers)
        if action == "delete" and response.status_code in (200, 204, 404):
            self.stored.forget(response_id)
        return response
