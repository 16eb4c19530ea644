"""What every proxied flow shares, so the flows cannot drift apart: admitting a request (who asks, within the limits,
its body parsed by its API), and forwarding it as decided, relaying the answer and accounting for it (every proxied
request writes exactly one request log line)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from kvgate.router.apis.base import Api
from kvgate.router.core.errors import ApiError
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.endpoints.callers import Callers
from kvgate.router.pipeline.account import Accounting
from kvgate.router.pipeline.admit import (
    Admission, check_client_ids, read_within_limits, resolve_tenant, upstream_headers,
)
from kvgate.router.pipeline.forward import Forwarder
from kvgate.router.pipeline.parse import Parsed, parse, salt_for_tenant
from kvgate.router.pipeline.relay import relay
from kvgate.router.routing.catalog import ModelCatalog
from kvgate.router.routing.records import Routed
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.upstream.proxy import AttemptFailed


@dataclass(slots=True)
class Admitted:
    admission: Admission
    parsed: Parsed
    upstream_headers: dict[str, str]
    """The headers the engine gets (:func:`~kvgate.router.pipeline.admit.upstream_headers`)."""


class ProxiedRequests:
    def __init__(
        self, holder: ConfigHolder, tenants: TenantResolver, callers: Callers, catalog: ModelCatalog,
        forwarder: Forwarder, accounting: Accounting,
    ) -> None:
        self.holder = holder
        self.tenants = tenants
        self.callers = callers
        self.catalog = catalog
        self.forwarder = forwarder
        self.accounting = accounting

    async def admit(self, request: Request, api: Api | None) -> Admitted:
        """Admit and parse: the tenant from the API key, client ids within bounds, the body within the limits and
        parsed by ``api`` (None: forwarded as it is), the tenant's cache salt set. Raises :class:`ApiError`, counted
        and logged as a refusal."""
        admission = Admission.of(request.scope)
        try:
            return await self._admitted(request, api, admission)
        except ApiError as e:
            self.accounting.rejected(e, admission)
            raise

    async def _admitted(self, request: Request, api: Api | None, admission: Admission) -> Admitted:
        config = self.holder.current
        tenants = self.tenants
        admission.tenant = resolve_tenant(tenants, admission.client.authorization)
        check_client_ids(admission.client, config.limits)
        raw = await read_within_limits(request, config.server, config.limits)
        headers = upstream_headers(admission.client, admission.request_id, tenants.enabled)
        parsed = parse(raw, api, self.catalog, self.callers.may_use(admission.tenant))
        if api is not None:
            parsed = salt_for_tenant(parsed, tenants, admission.tenant)
        return Admitted(admission, parsed, headers)

    def refused(self, admitted: Admitted, err: ApiError) -> ApiError:
        """A refusal after parsing (no replica, a prompt the engine would refuse), counted and logged."""
        self.accounting.rejected(err, admitted.admission)
        return err

    async def answer(self, request: Request, path: str, admitted: Admitted, routed: Routed) -> Response:
        """Forward as ``routed`` says, relay the answer (streamed as asked), account for it."""
        admission, parsed = admitted.admission, admitted.parsed
        try:
            up = await self.forwarder.send(request, path, parsed, routed, admitted.upstream_headers)
        except AttemptFailed as failed:
            return self.accounting.failed(failed, routed, admission, self.holder.current.proxy.max_attempts)
        if up is None:
            return self.accounting.client_left(routed, admission)
        finished = functools.partial(self.accounting.answered, routed, admission, parsed.api)
        return relay(up, parsed.api, admission.request_id, routed.decision.reason, parsed.stream, finished)
