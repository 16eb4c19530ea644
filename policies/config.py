"""The policies' and the cost model's sections of the policy file: a model's cost constants (``models[].prefill``),
the policy, cost-model calibration, KV transfers, prefill/decode disaggregation and hot-prefix replication. A policy
is built from its own section and the cost model's (:func:`kvgate.policies.registry.create_policy`,
:meth:`kvgate.policies.cost_model.CostModel.from_config`), never from the whole file."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvgate.policies.section import Section


class PrefillCost(Section):
    """prefill_ms(n) = fixed_ms + per_token_ms * n + quadratic_ms * n^2 / 1e6 (the service model in docs/design.md)."""

    fixed_ms: float = Field(20.0, ge=0)
    """Fixed prefill cost per request (scheduling, first step), ms."""
    per_token_ms: float = Field(0.035, ge=0)
    """Prefill cost per uncached prompt token, ms."""
    quadratic_ms: float = Field(0.0, ge=0)
    """Extra ms per million squared tokens, for attention's quadratic share on long contexts."""
    decode_ms_per_token: float = Field(0.0, ge=0)
    """Expected per-output-token cost on a busy replica; used to convert running sequences into queue delay."""
    queue_scale: float = Field(1.0, ge=0)
    """Multiplies the queue delay the model adds up from the work ahead of a request (the calibrator fits it from
    measured first tokens and from answers read whole that came back sooner than predicted: near 0 when that sum
    predicts nothing, e.g. an engine that batches what it counts as queued)."""


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
    """Weight of the delay a candidate's prefill imposes on the other requests arriving at that replica while it waits
    there and while it runs (queue scale × arrival rate × prefill × (queue delay + prefill / 2): a queue delay,
    scaled as calibration scales the queue term), added to its predicted TTFT when candidates are compared; 0
    compares TTFT alone."""
    eviction_weight: float = Field(1.0, ge=0)
    """Weight of the prefill the fleet is expected to lose to the evictions a candidate's copy causes on a full
    replica (its new tokens beyond the fewest any candidate must store, beyond its free room, × its cache's value per
    token at the margin), added when candidates are compared; 0 ignores cache capacity. What a request stores wherever
    it goes (a cold prompt, a warm holder's uncached suffix) is not priced: the cheapest cache to evict from is the
    fastest-churning, the busiest replica's."""
    session_turns_ahead: float = Field(4.0, ge=0)
    """Later turns a new session's placement is priced for: a request that starts a session (an X-Session-ID no
    replica has served) is charged, on each candidate, what that many of its turns would cost the fleet there
    (:meth:`kvgate.policies.cost_model.CostModel.session_load_ms`), since its later turns follow their cache to the
    replica chosen now; 0 prices the first turn alone. Scaled by the share of the tenant's recent sessions that came
    back after their first request, so ids that never return (a fresh one per request) price nothing."""
    decode_stall_weight: float = Field(1.0, ge=0)
    """In a fleet with prefill replicas: weight of the stall a candidate's prefill puts on the sequences decoding on
    its replica (running decodes × prefill ms: with chunked prefill each of them waits for it), added when candidates
    are compared. What disaggregation avoids; 0 compares TTFT alone."""


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
    """Fit each model's fixed_ms, per_token_ms and queue_scale from the engines' measured first tokens, timed from
    dispatch (streamed answers), and from answers read whole where their whole time is less than the model predicted
    for their first token (a bound, so it only ever lowers an over-prediction)."""
    window: int = Field(512, ge=16)
    """Observations kept for the robust fit."""
    min_samples: int = Field(32, ge=4)
    """Observations needed before the fit replaces the policy file's coefficients."""
    max_change: float = Field(0.5, gt=0)
    """Fitted coefficients stay within (1 ± max_change) of the policy file's values (queue_scale between 0 and
    1 + max_change times the file's)."""


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


class DisaggregationConfig(Section):
    """Prefill/decode disaggregation: when a request's prefill runs on a ``prefill``-role replica and its KV moves to
    the replica that decodes it (docs/disaggregation.md). Without a prefill replica, nothing is disaggregated."""

    mode: Literal["cost", "always", "threshold"] = "cost"
    """cost: per request, whichever of local prefill and disaggregation the cost model prices lower (TTFT plus the
    stall a local prefill puts on running decodes); always: every request is disaggregated (the static peers' rule);
    threshold: disaggregated when its uncached prompt tokens reach ``threshold_tokens`` (llm-d's selective P/D).
    Every mode picks the prefill replica by its predicted prefill (cache-aware) and the decode replica by load."""
    threshold_tokens: int = Field(256, ge=0)
    """``threshold`` mode: uncached prompt tokens (on the replica that would serve the request locally) at or above
    which a request is disaggregated."""


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
    """The fleet's budget of warm-up prefill work: gateways that share work reports (``peers.hints``) each plan
    within an equal share of it."""
    min_prefix_tokens: int = Field(256, ge=0)
    """Prefixes shorter than this are never replicated (recompute is cheap)."""
    marked_prefixes: bool = True
    """Also count the prefix a request marks as one every session sends again (Anthropic ``cache_control`` on its
    tools or system) as a candidate, beside the deepest prefix a replica holds: a session's own history is the
    deepest, and without the mark the system prompt all sessions share would be seen only on their first turns."""
    warmup_timeout_s: float = Field(30.0, gt=0)
    """A started warm-up blocks further warm-ups of its prefix until its target holds it or this long passed."""
