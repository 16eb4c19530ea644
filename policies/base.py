"""The small interface every routing policy implements, and the snapshots it decides on.

A policy is one file: a class with a ``name`` and a ``decide`` method, registered in :mod:`policies.registry`.
It sees a snapshot of the request (:class:`RouteRequest`) and of each replica (:class:`ReplicaView`), and
returns a :class:`Decision`: where to send the request, which action to take, a short reason for the response
header, and the numbers behind it for ``/kvgate/v1/explain``. ``ranked`` lists the replicas in the order a retry
should try them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Sequence

from kvgate.cache_index.match import PrefixMatch

Action = Literal["route", "transfer", "disaggregate"]
Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request once it is parsed and tokenized."""

    request_id: str
    model: str
    prompt_tokens: int
    block_size: int
    approximate: bool = False
    """Token ids were estimated (no tokenizer for this model): matches may be wrong, so decisions lean on load."""
    session_id: str | None = None
    new_session: bool = False
    """It carries a session id no replica has served yet: it starts a session, whose later turns will follow their
    cache to the replica chosen now."""
    session_return_share: float = 1.0
    """For a new session: the share of its tenant's recent sessions that came back after their first request (a
    client that sends a fresh session id with every request has no later turns to price)."""
    tenant: str | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CacheMargin:
    """A replica's cache at the margin (priced by :mod:`policies.capacity`): what losing one token of it costs the fleet, and why."""

    ms_per_token: float
    """Expected prefill (ms) the fleet spends recomputing what one token of new blocks evicts here."""
    residence_s: float
    """How long a block survives here without a hit (the age of the least recently used prefix still held)."""
    reuses_per_token: float
    """Expected reuses of an evicted token during ``residence_s`` (before the cap at one recompute)."""

    def as_dict(self) -> dict[str, float]:
        return {"ms_per_token": self.ms_per_token, "residence_s": self.residence_s,
                "reuses_per_token": self.reuses_per_token}


@dataclass(slots=True)
class ReplicaView:
    """One replica as a policy sees it, taken at decision time. Read-only by convention: the router builds one per
    replica per request, and a frozen dataclass's construction costs about twice as much."""

    name: str
    healthy: bool
    """Routable: passes health checks, circuit breaker closed (or half-open and admitting a probe), not draining."""
    match: PrefixMatch
    """Leading prompt tokens this replica holds, per tier (from the prefix index)."""
    can_source: bool = False
    """Its engine can serve a transfer's prefill-only first leg: health checks pass and the breaker is closed, even
    while draining. A draining replica takes no new requests but still holds its cache: pulling its KV beats
    recomputing a long prefix elsewhere. A replica failing requests (breaker open or half-open) is never a source."""
    draining: bool = False
    """Taken out of rotation by an operator (``/admin/replicas/{name}/drain``): no new requests, cache kept."""
    in_flight: int = 0
    """Requests the router has dispatched to this replica and not yet seen complete."""
    in_flight_prefill_tokens: int = 0
    """Uncached prompt tokens of in-flight requests that have not produced a first token yet (the router's own, plus
    what peer gateways reported of theirs)."""
    in_flight_prefilling: int = 0
    """In-flight requests that have not produced a first token yet (the ones ``in_flight_prefill_tokens`` sums)."""
    arrival_rate_per_s: float = 0.0
    """Requests per second the router sent here lately (decayed): how many requests a long prefill started now would
    hold up behind it. The larger of this gateway's own dispatch rate and the engine's scraped finish rate, which
    counts the work other gateway replicas and direct callers send it."""
    scraped_waiting: int | None = None
    """Engine-reported waiting queue (``vllm:num_requests_waiting``); None when unknown or stale."""
    scraped_running: int | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    """Tokens the engine's GPU KV cache holds at most (its scraped block count × block size); None when unknown."""
    kv_held_tokens: int | None = None
    """Tokens the prefix index says the replica holds (confirmed by its KV events); None when unknown."""
    cache_margin: CacheMargin | None = None
    """What one token of this replica's cache is worth to the fleet at the margin (:mod:`policies.capacity`):
    the price of what new blocks evict once it is full. None when nothing it holds is known to be reused."""
    generation: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    """The replica's configured labels (its config's own dict: read it, never change it)."""
    role: Role = "both"
    """Its part in prefill/decode disaggregation: a ``prefill`` replica never takes a client's request (every policy
    leaves it out, :func:`policies.load.eligible`); it only runs the prefill leg of a disaggregated one."""
    engine: str = "vllm"
    """The engine kind (vllm, sglang): a disaggregated request pairs replicas of one kind (one handoff protocol)."""
    last_session_match: bool = False
    """This replica served the request's session last time (a soft hint only)."""


@dataclass(slots=True)
class Decision:
    replica: str
    action: Action = "route"
    reason: str = ""
    """Short, for the ``x-kvgate-decision`` header and the decision metrics, e.g. ``warm``, ``idle-recompute``."""
    source: str | None = None
    """For ``transfer``: the warm replica the KV is pulled from; for ``disaggregate``: the prefill replica."""
    ranked: list[str] = field(default_factory=list)
    """Every eligible replica, best first (``replica`` first); retries walk this list."""
    details: dict[str, Any] = field(default_factory=dict)
    """The numbers behind the decision (per-replica predicted TTFT, queue delay...), for ``/kvgate/v1/explain``;
    filled only when the policy is asked to ``explain``."""
    ttft_ms: dict[str, float] | None = None
    """Each eligible replica's predicted TTFT for a local prefill (queue delay included), when the policy priced them
    (the cost policy does), so the gateway need not price them again for the attempts' deadlines."""
    load_ms: float | None = None
    """For a ``route`` the policy priced: the part of the chosen replica's predicted TTFT spent loading its cached
    tiers' blocks back. Held to the engine's outcome by the benchmark's prediction audit."""
    interference_ms: float | None = None
    """For a ``route`` the policy priced: the delay its prefill is predicted to impose on the other requests arriving
    at the chosen replica while it waits and runs there. Held to the engine's outcome like ``load_ms``."""


class Policy(Protocol):
    """A routing policy. Implementations keep only their own small state (a round-robin cursor, a RNG)."""

    name: ClassVar[str]

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        """Pick a replica among ``replicas`` (all candidates, healthy or not; never pick an unhealthy one while a
        healthy one exists). ``replicas`` is never empty. With ``explain``, also fill ``Decision.details``: only
        ``/kvgate/v1/explain`` reads them, so the request path does not pay for building them."""
        ...


class NoHealthyReplica(Exception):
    """Raised by the router (not by policies) when no replica can take a request."""
