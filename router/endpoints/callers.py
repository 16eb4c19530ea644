"""Who may call what: with tenants, a tenant's API key (its tenant) or the admin token; kvgate's own tokens for its
own endpoints (:mod:`kvgate.router.core.auth`); and which models a tenant may use."""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvgate.router.core.auth import Credentials
from kvgate.router.core.errors import ApiError
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.pipeline.admit import ClientHeaders, resolve_tenant
from kvgate.router.settings.holder import ConfigHolder


class Callers:
    def __init__(self, tenants: TenantResolver, holder: ConfigHolder) -> None:
        self.tenants = tenants
        self.holder = holder

    @property
    def credentials(self) -> Credentials:
        """kvgate's own tokens in force (the policy file's, else the environment's)."""
        return Credentials.of(self.holder.current.server)

    def require_caller(self, client: ClientHeaders) -> tuple[str | None, bool]:
        """Who may send requests may also list models: with tenants, a tenant key or the admin token (else 401).
        The caller's tenant, and whether it is the admin."""
        if self.credentials.is_admin(client.authorization):
            return None, True
        return resolve_tenant(self.tenants, client.authorization), False

    def may_call(self, client: ClientHeaders) -> bool:
        try:
            self.require_caller(client)
        except ApiError:
            return False
        return True

    def may_use(self, tenant: str | None) -> Callable[[str], bool]:
        """Which models ``tenant`` may use (``tenants.models``)."""
        return functools.partial(self.tenants.may_use, tenant)

    def explain_caller(self, client: ClientHeaders, tenant_header: str | None) -> tuple[str | None, bool]:
        """Whom explain answers: (tenant whose namespace is looked up, whether the caller sees everything).

        The admin token sees everything, in the namespace of the tenant named by ``X-Kvgate-Tenant`` (none: requests
        without a tenant). Otherwise explain answers whoever may send requests: with tenants, a tenant key, in that
        tenant's own namespace and without any figure that moves with other tenants' traffic
        (:func:`~kvgate.router.endpoints.explain.tenant_view`)."""
        if self.credentials.is_admin(client.authorization):
            return tenant_header or None, True
        tenant = resolve_tenant(self.tenants, client.authorization)
        return tenant, tenant is None
