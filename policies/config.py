"""The policy file: one YAML document, validated into a typed config.

Every field has a default and a docstring; README's "Policy file" section lists them. A bad file is rejected with the
dotted path of the offending field (pydantic's ``loc``) and the problem. Unknown keys are errors, so a typo never
silently does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address kvgate listens on (CLI --host overrides)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port kvgate listens on (CLI --port overrides)."""
    admin_token: str | None = None
    """Bearer token for /admin/* (also read from env KVGATE_ADMIN_TOKEN); admin endpoints are off when unset."""
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    """Request bodies above this get 413."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT: stop accepting, let in-flight streams finish up to this long, then cancel them."""
    log_requests: bool = True
    """One JSON line per request at info level."""


class ReplicaConfig(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Unique replica name (letters, digits, _ . : -); shown in x-kvgate-replica, metrics and logs."""
    url: str
    """Base URL of the engine's HTTP server, e.g. http://10.0.0.5:8000."""
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV-event publisher (e.g. tcp://10.0.0.5:5557); no prefix index for it if unset."""
    kv_replay: str | None = None
    """ZMQ endpoint of the engine's replay ROUTER socket; gaps purge instead of repair if unset."""
    kv_topic: str = ""
    """SUB topic filter (vLLM's ``topic``; empty receives all)."""
    engine: Literal["vllm", "sglang"] = "vllm"
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form labels (e.g. zone, GPU type), shown by /admin/replicas."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class PrefillCost(Section):
    """prefill_ms(n) = fixed_ms + per_token_ms * n + quadratic_ms * n^2 / 1e6 (DESIGN.md's service model)."""

    fixed_ms: float = Field(20.0, ge=0)
    """Fixed prefill cost per request (scheduling, first step), ms."""
    per_token_ms: float = Field(0.035, ge=0)
    """Prefill cost per uncached prompt token, ms."""
    quadratic_ms: float = Field(0.0, ge=0)
    """Extra ms per million squared tokens, for attention's quadratic share on long contexts."""
    decode_ms_per_token: float = Field(0.0, ge=0)
    """Expected per-output-token cost on a busy replica; used to convert running sequences into queue delay."""


class ModelConfig(Section):
    name: str
    """Model name as clients send it and engines serve it."""
    tokenizer: str | None = None
    """Local model directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json path."""
    block_size: int = Field(16, ge=1)
    """Engine KV block size in tokens; learned from events / cache_config_info when they say otherwise."""
    weight_version: str = ""
    """Changing it starts a new namespace: every old cached prefix simply misses."""
    prefill: PrefillCost = PrefillCost()
    kv_bytes_per_token: int = Field(320 * 1024, gt=0)
    """KV-cache bytes per token (all layers); sizes transfers."""


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
    """Consecutive request failures (connect error, timeout, 5xx) that open a replica's circuit."""
    open_s: float = Field(10.0, gt=0)
    """How long an open circuit rejects before admitting one half-open probe request."""


class ProxyConfig(Section):
    connect_timeout_s: float = Field(2.0, gt=0)
    """Upstream TCP connect timeout; a refused or timed-out connect is retried on the next replica."""
    first_byte_timeout_s: float = Field(60.0, gt=0)
    """Upstream must send response headers within this (long prefills count here)."""
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


class ScrapeConfig(Section):
    interval_ms: float = Field(100.0, gt=0)
    """How often each engine's /metrics is scraped."""
    stale_after_ms: float = Field(2000.0, gt=0)
    """Scraped numbers older than this are ignored (the router's own in-flight counts still apply)."""


class IndexConfig(Section):
    max_entries: int = Field(5_000_000, ge=1)
    """Cap on (block, replica) holdings; least recently matched chains are evicted first."""
    predicted_ttl_s: float = Field(2.0, ge=0)
    """Blocks of a just-routed prompt count as held ("predicted") on that replica for this long, or until confirmed."""
    replay_timeout_s: float = Field(2.0, gt=0)
    """How long a replay request may take before the replica is purged instead."""


class TenantsConfig(Section):
    api_keys: dict[str, str] = Field(default_factory=dict)
    """API key → tenant name. When this or keys_file is set, every request needs a valid key (else 401)."""
    keys_file: str | None = None
    """File of ``sha256hex tenant`` lines (hashed keys), re-read on reload."""

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.keys_file is not None


class CostPolicyConfig(Section):
    tie_margin: float = Field(0.05, ge=0)
    """Candidates within this fraction of the best predicted TTFT are near-ties, broken by load then randomly."""
    tie_margin_ms: float = Field(5.0, ge=0)
    """Absolute near-tie margin, so tiny TTFTs do not split hairs."""
    session_bonus_ms: float = Field(10.0, ge=0)
    """A request's X-Session-ID last replica is credited this many ms (a soft hint, never a pin)."""
    approximate_match_weight: float = Field(0.5, ge=0, le=1)
    """Matches computed from approximate token ids are credited at this fraction."""
    interference_weight: float = Field(1.0, ge=0)
    """Weight of the delay a candidate's prefill imposes on the other requests arriving at that replica while it runs
    (arrival rate × prefill² / 2), added to its predicted TTFT when candidates are compared; 0 compares TTFT alone."""


class PrefixAffinityConfig(Section):
    """The SGLang Model Gateway's cache_aware rule with its CLI defaults."""

    cache_threshold: float = Field(0.3, ge=0, le=1)
    """Matched fraction of the prompt above which the best-matching replica wins."""
    balance_abs_threshold: int = Field(64, ge=0)
    """Load is imbalanced when max - min load exceeds this ..."""
    balance_rel_threshold: float = Field(1.5, ge=1)
    """... and max load exceeds min load times this; then the least-loaded replica wins."""


class PolicyConfig(Section):
    name: str = "cost"
    """cost | prefix_affinity | least_loaded | round_robin (CLI --policy overrides)."""
    cost: CostPolicyConfig = CostPolicyConfig()
    prefix_affinity: PrefixAffinityConfig = PrefixAffinityConfig()
    tier_load_ms_per_token: dict[Literal["cpu", "storage"], float] = Field(
        default_factory=lambda: {"cpu": 0.015, "storage": 0.03}
    )
    """Cost of using a token held in a lower tier (host-to-GPU load) instead of the GPU, in ms per token."""


class CalibrationConfig(Section):
    enabled: bool = True
    window: int = Field(512, ge=16)
    """Observations kept for the robust fit."""
    min_samples: int = Field(32, ge=4)
    """Observations needed before the fit replaces the policy file's coefficients."""
    max_change: float = Field(0.5, gt=0)
    """Fitted coefficients stay within (1 ± max_change) of the policy file's values."""


class TransferConfig(Section):
    connector: Literal["none", "nixl"] = "none"
    """KV connector between replicas; transfers are considered only when it is not "none"."""
    setup_ms: float = Field(12.0, ge=0)
    """Fixed cost of one KV transfer (handshake, registration), ms."""
    bandwidth_gib_s: float = Field(22.0, gt=0)
    """KV link bandwidth between replicas, GiB/s."""
    min_tokens: int = Field(1024, ge=0)
    """Never transfer prefixes shorter than this (setup dominates)."""
    first_leg_timeout_s: float = Field(30.0, gt=0)
    """Timeout of the prefill-only first leg on the source; on expiry the destination recomputes."""


class ReplicationConfig(Section):
    enabled: bool = True
    """Warm hot prefixes on more replicas (whatever the policy; the warmed replicas pay off under ``cost``, which
    spreads a prefix's traffic over its holders by queue delay)."""
    half_life_s: float = Field(10.0, gt=0)
    """Decay of each prefix's request rate."""
    min_saving_ms_per_s: float = Field(200.0, ge=0)
    """A prefix is hot when rate × prefill it saves exceeds this many ms per second."""
    max_replicas_per_prefix: int = Field(4, ge=1)
    """Most replicas one hot prefix is kept warm on."""
    warmup_budget_tokens_per_s: float = Field(200_000.0, ge=0)
    """Global budget of warm-up prefill work."""
    min_prefix_tokens: int = Field(256, ge=0)
    """Prefixes shorter than this are never replicated (recompute is cheap)."""
    warmup_timeout_s: float = Field(30.0, gt=0)
    """A started warm-up blocks further warm-ups of its prefix until its target holds it or this long passed."""


class KvgateConfig(Section):
    """The whole policy file."""

    server: ServerConfig = ServerConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    """The engine replicas (more can be added at runtime through /admin/replicas)."""
    models: list[ModelConfig] = Field(default_factory=list)
    """Per-model tokenizer, block size, weight version and cost constants."""
    health: HealthConfig = HealthConfig()
    breaker: BreakerConfig = BreakerConfig()
    proxy: ProxyConfig = ProxyConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    index: IndexConfig = IndexConfig()
    tenants: TenantsConfig = TenantsConfig()
    policy: PolicyConfig = PolicyConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    transfer: TransferConfig = TransferConfig()
    replication: ReplicationConfig = ReplicationConfig()

    @model_validator(mode="after")
    def _unique_names(self) -> "KvgateConfig":
        names = [r.name for r in self.replicas]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"replicas: duplicate name(s) {sorted(dup)}")
        models = [m.name for m in self.models]
        if len(set(models)) != len(models):
            raise ValueError("models: duplicate model name")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


class ConfigError(Exception):
    """A policy file that cannot be used; the message names the field and the problem."""


def format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def parse_config(text: str, source: str = "<policy file>") -> KvgateConfig:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    try:
        return KvgateConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {format_validation_error(e)}") from e


def load_config(path: str | Path) -> KvgateConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from e
    return parse_config(text, str(p))
