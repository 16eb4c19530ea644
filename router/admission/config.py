"""The ``admission`` section of the policy file: when the fleet counts as saturated, how requests wait, and each
tenant's class (priority, share, limits)."""

from __future__ import annotations

from pydantic import Field

from kvgate.policies.section import Section


class TenantClass(Section):
    """What one tenant (or every tenant without a class of its own) gets."""

    priority: int = 0
    """The band its requests wait in when they name no priority themselves (vLLM's meaning: lower runs first; a
    request's ``priority`` field or ``X-Vllm-Priority`` header overrides it)."""
    weight: float = Field(1.0, gt=0)
    """Its share of the fleet while tenants wait in one band, in prefill tokens: a tenant of weight 2 is released
    twice the prompt tokens of a tenant of weight 1."""
    max_concurrent: int | None = Field(None, ge=1)
    """Most of its requests admitted and not yet answered (waiting ones included); beyond, 429."""
    requests_per_s: float | None = Field(None, gt=0)
    """Sustained requests per second (a token bucket holding ``burst_s`` seconds of it); beyond, 429."""
    prompt_tokens_per_s: float | None = Field(None, gt=0)
    """Sustained prompt tokens per second, the same way; a prompt larger than the bucket is refused outright."""
    burst_s: float = Field(1.0, gt=0)
    """How many seconds of each rate a bucket holds: the burst a tenant may send at once."""


class AdmissionConfig(Section):
    enabled: bool = True
    """Queue at the gateway when the fleet is saturated. Off, every request is forwarded at once (limits still
    apply)."""
    max_start_delay_ms: float = Field(200.0, ge=0)
    """The fleet is saturated for a model when none of its replicas could start a new request within this: the cost
    model's queue delay there (the prefills ahead of it, from this gateway and its peers, the engine's own waiting
    queue, decode interference) is longer, its KV cache is fuller than ``max_kv_usage``, or its scraped load went
    stale (fail closed)."""
    max_kv_usage: float = Field(0.98, gt=0, le=1)
    """A replica whose engine reports more of its KV cache in use than this cannot start a request (it would
    preempt)."""
    headroom: float = Field(0.25, ge=0, lt=1)
    """The fraction of a model's replicas (rounded down) a tenant already holding at least its weighted share of
    what is in flight never takes while other tenants are active: those replicas stay able to start the others'
    requests at once, so a flood costs them no wait behind its prefills. 0: work-conserving, first come first
    served between tenants once released."""
    deadline_s: float = Field(30.0, gt=0)
    """Longest a request waits before it is refused with 503 and ``Retry-After``."""
    band_deadlines_s: dict[int, float] = Field(default_factory=dict)
    """Deadlines of particular priority bands, overriding ``deadline_s`` (e.g. ``{0: 10, 10: 120}``)."""
    max_waiting: int = Field(1024, ge=0)
    """Most requests waiting at once; beyond, 503 with ``Retry-After``."""
    max_waiting_bytes: int = Field(256 * 1024 * 1024, ge=0)
    """Most request body bytes waiting at once; beyond, 503 with ``Retry-After``."""
    forward_priority: bool = False
    """Put each request's priority into the body the engine gets (``priority``), for engines started with
    ``--scheduling-policy priority`` (any other vLLM refuses a non-zero priority)."""
    default_class: TenantClass = Field(default_factory=TenantClass)
    """The class of every tenant not named in ``tenants`` (and of requests without tenants)."""
    tenants: dict[str, TenantClass] = Field(default_factory=dict)
    """Tenant name → its class."""

    def class_of(self, tenant: str | None) -> TenantClass:
        return self.tenants.get(tenant, self.default_class) if tenant is not None else self.default_class

    def deadline_of(self, band: int) -> float:
        return self.band_deadlines_s.get(band, self.deadline_s)
