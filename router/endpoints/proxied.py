"""What every proxied flow shares, so the flows cannot drift apart: admitting a request (who asks, within the limits,
its body parsed by its API), refusing one in its API's own error shape, and forwarding it as decided, relaying the
answer and accounting for it (every proxied request writes exactly one request log line)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.responses import Response

from kvgate.router.admission.gate import Ticket
from kvgate.router.apis.base import Api
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest, StreamedAnswer
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.endpoints.callers import Callers
from kvgate.router.pipeline.account import Accounting, Answered
from kvgate.router.pipeline.admit import (
    Admission, check_client_ids, read_within_limits, resolve_tenant, upstream_headers,
)
from kvgate.router.pipeline.forward import Forwarder
from kvgate.router.pipeline.parse import Parsed, parse, parse_forwarded, salt_for_tenant
from kvgate.router.pipeline.relay import relay
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.records import Routed
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.upstream.proxy import AttemptFailed

if TYPE_CHECKING:
    from kvgate.router.pipeline.spans import RequestTracer


@dataclass(slots=True)
class Admitted:
    admission: Admission
    parsed: Parsed
    upstream_headers: dict[str, str]
    """The headers the engine gets (:func:`~kvgate.router.pipeline.admit.upstream_headers`)."""


class ProxiedRequests:
    def __init__(
        self, holder: ConfigHolder, tenants: TenantResolver, callers: Callers, catalog: ModelCatalog,
        forwarder: Forwarder, accounting: Accounting, tracer: RequestTracer | None = None,
    ) -> None:
        self.holder = holder
        self.tenants = tenants
        self.callers = callers
        self.catalog = catalog
        self.forwarder = forwarder
        self.accounting = accounting
        self.tracer = tracer
        """None when the gateway does not trace (:func:`kvgate.router.gateway.start_tracing`)."""

    async def admit(self, request: HttpRequest, api: Api, admission: Admission) -> Admitted:
        """Admit and parse: the tenant from the API key, client ids within bounds, the body within the limits and
        parsed by ``api``, the tenant's cache salt set, and a session from the body when no header named one.
        Raises :class:`ApiError`."""
        raw, headers = await self._read(request, admission, json=True)
        parsed = parse(raw, api, self.catalog, self.callers.may_use(admission.tenant),
                       self.holder.current.limits.max_id_chars)
        parsed = salt_for_tenant(parsed, self.tenants, admission.tenant)
        if admission.client.session_id is None:
            admission.client.session_id = parsed.session_id
        if admission.trace is not None:
            admission.trace.admitted(parsed, admission.tenant)
        return Admitted(admission, parsed, headers)

    async def admit_forwarded(self, request: HttpRequest, admission: Admission, *, model_optional: bool) -> Admitted:
        """Admit a body forwarded as it is (embeddings, rerank, an audio upload): read only for its model, and sent
        with the client's own content type."""
        content_type = request.header("content-type")
        is_json = content_type is None or "json" in content_type.lower()
        raw, headers = await self._read(request, admission, json=is_json)
        parsed = parse_forwarded(raw, content_type, self.catalog, self.callers.may_use(admission.tenant),
                                 model_optional=model_optional)
        if content_type is not None:
            headers["content-type"] = content_type
        if admission.trace is not None:
            admission.trace.admitted(parsed, admission.tenant)
        return Admitted(admission, parsed, headers)

    async def admit_bodiless(self, request: HttpRequest, admission: Admission) -> Admitted:
        """Admit a request that carries no body to read (a GET, a DELETE): who asks, within the limits."""
        raw, headers = await self._read(request, admission, json=True)
        if raw:
            raise ApiError(400, "this request takes no body", code="invalid_body")
        return Admitted(admission, Parsed(raw, {}, "", False, None, None), headers)

    async def _read(self, request: HttpRequest, admission: Admission, *, json: bool) -> tuple[bytes, dict[str, str]]:
        config = self.holder.current
        if self.tracer is not None:
            admission.trace = self.tracer.begin(request.method, request.route, request.path,
                                                admission.client.traceparent, admission.client.tracestate,
                                                admission.request_id)
        admission.tenant = resolve_tenant(self.tenants, admission.client.authorization)
        check_client_ids(admission.client, config.limits)
        raw = await read_within_limits(request, config.server, config.limits, json=json)
        return raw, upstream_headers(admission.client, admission.request_id, self.tenants.enabled,
                                     traced=admission.trace is not None)

    def refuse(self, err: ApiError, admission: Admission, api: Api | None) -> Response:
        """A refusal (auth, limits, a bad body or prompt, no replica), counted, logged and answered in ``api``'s
        error shape."""
        self.accounting.rejected(err, admission, api)
        return err.response(shape=api.errors if api is not None else None)

    def left_waiting(self, admission: Admission, api: Api) -> Response:
        """The client left while its request waited for capacity: logged as a client-closed request."""
        return self.refuse(ApiError(499, "the client closed the request while it waited", code="client_closed"),
                           admission, api)

    async def answer(
        self, request: HttpRequest, path: str, admitted: Admitted, routed: Routed, *, method: str = "POST",
        answered: Answered | None = None, ticket: Ticket | None = None,
    ) -> Response | StreamedAnswer:
        """Forward as ``routed`` says, relay the answer (streamed as asked), account for it, then tell ``answered``;
        the admission ``ticket`` is given back once the answer is complete, however it ends."""
        admission, parsed = admitted.admission, admitted.parsed
        api = parsed.api
        try:
            up = await self.forwarder.send(request, path, parsed, routed, admitted.upstream_headers, method,
                                           admission.trace)
        except BaseException as err:
            if ticket is not None:
                ticket.release()
            if isinstance(err, AttemptFailed):
                return self.accounting.failed(err, routed, admission, self.holder.current.proxy.max_attempts, api)
            raise
        if up is None:
            if ticket is not None:
                ticket.release()
            return self.accounting.client_left(routed, admission, api)
        finished = functools.partial(self.accounting.answered, routed, admission, api, then=answered, ticket=ticket)
        return relay(up, api, admission.request_id, routed.decision.reason, parsed.stream, finished)

