"""The upstream client's sections of the policy file: the proxy, circuit breakers, health checks, metric scraping."""

from __future__ import annotations

from pydantic import Field

from kvgate.policies.section import Section


class HealthConfig(Section):
    interval_s: float = Field(2.0, gt=0)
    """Seconds between active GET /health checks of each replica."""
    timeout_s: float = Field(1.0, gt=0)
    """A health check slower than this counts as failed."""
    failures_to_down: int = Field(3, ge=1)
    """Consecutive failed checks that mark a replica down."""
    successes_to_up: int = Field(2, ge=1)
    """Consecutive good checks that mark a down replica up again (with a new generation)."""


class BreakerConfig(Section):
    failures_to_open: int = Field(5, ge=1)
    """Consecutive request failures blamed on a replica that open its circuit: a connection it refused, or a timeout,
    reset or 5xx of a request that then succeeded on another replica (a request that fails everywhere, or that the
    engine refuses with a 4xx, is never the replica's fault)."""
    min_callers_to_open: int = Field(2, ge=1)
    """The failures that open a circuit must come from requests of at least this many tenants, or of every tenant
    that sent the replica requests in the last minute when fewer did: one tenant cannot eject a replica that serves
    others."""
    max_ejected_fraction: float = Field(0.5, gt=0, le=1)
    """At most this fraction of the fleet's replicas may have an open circuit at once (at least one may): a circuit
    that would eject more stays closed, as Envoy's ``max_ejection_percent``."""
    open_s: float = Field(10.0, gt=0)
    """How long a first opening rejects before admitting one half-open probe request; each further opening without
    a recovery in between doubles it (Envoy's outlier detection), up to ``max_open_s``."""
    max_open_s: float = Field(300.0, gt=0)
    """Longest ejection. A circuit that stays closed this long forgets its earlier openings."""


class ProxyConfig(Section):
    connect_timeout_s: float = Field(2.0, gt=0)
    """Upstream TCP connect timeout; a refused or timed-out connect is retried on the next replica."""
    first_byte_timeout_s: float = Field(60.0, gt=0)
    """Cap on the first-byte deadline: the longest an attempt waits for the engine's first token (streaming) or its
    whole answer (not streaming) before it is abandoned, counted against the replica's breaker and retried elsewhere
    (when nothing reached the client yet), however busy the replica. Also the deadline when there is no prediction
    (embeddings, warm-ups)."""
    first_byte_floor_s: float = Field(10.0, gt=0)
    """Least first-byte deadline of a routed request: a short prompt's predicted TTFT is milliseconds, and a busy
    engine's real TTFT can be many times its prediction (queues behind other gateways, preemption) without it being
    broken. A deadline missed while the replica keeps answering other requests (a first output, a served request, its
    finished counter moving) is put off by another deadline, up to first_byte_timeout_s: the request is queued
    there, and leaving would start its prefill over elsewhere. A replica that answers nothing in a deadline's time
    loses the request to the next one."""
    first_byte_ttft_multiplier: float = Field(10.0, ge=1)
    """The first-byte deadline of a routed request is this many times the cost model's predicted TTFT on the replica
    tried (queue delay included), at least first_byte_floor_s, at most first_byte_timeout_s: a replica that accepts
    connections and never answers costs a request seconds, not the cap."""
    first_byte_ms_per_output_token: float = Field(200.0, ge=0)
    """A non-streaming answer comes after its decode: each token of its max_tokens (or max_completion_tokens) adds
    this to the deadline; without either, a non-streaming request gets the cap."""
    total_timeout_s: float = Field(1800.0, gt=0)
    """Upper bound on one upstream request, streaming included."""
    max_attempts: int = Field(3, ge=1)
    """Tries per request, across replicas, before any byte reached the client."""
    backoff_base_ms: float = Field(20.0, ge=0)
    """First retry backoff; doubles per attempt, with full jitter."""
    backoff_max_ms: float = Field(500.0, ge=0)
    """Cap on one retry backoff."""
    pool_size_per_replica: int = Field(256, ge=1)
    """Keep-alive connection pool size per replica."""
    max_answer_bytes: int = Field(256 * 1024 * 1024, ge=65536)
    """Largest answer kvgate reads whole from an engine (a non-streamed answer, an error body; streams are relayed
    as they come). Past it the attempt is abandoned and the client gets a 502: the request asked for that answer, so
    no other replica is tried and none is blamed."""


class ScrapeConfig(Section):
    interval_ms: float = Field(100.0, gt=0)
    """How often each engine's /metrics is scraped."""
    stale_after_ms: float = Field(2000.0, gt=0)
    """Scraped numbers older than this are ignored (the router's own in-flight counts still apply)."""
