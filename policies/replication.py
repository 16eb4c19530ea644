"""Hot-prefix replication planning: when one replica cannot serve a prefix's traffic, make another one warm.

The cost policy alone spreads a hot prefix only by recomputing it on idle replicas request after request. When a
prefix is hot enough, it pays to warm one more replica once — with a background prefill-only request, or a KV
transfer when that is cheaper — and let the cost policy spread the traffic from then on. This module decides
*which* prefix to warm *where*; the router executes the warm-ups and reports back through :meth:`record`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

from kvgate.policies.base import CacheMargin, ReplicaView
from kvgate.policies.capacity import HeldPrefix, cache_margin, eviction_ms
from kvgate.policies.config import ReplicationConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.rate import DecayedRate

RETIRE_FRACTION = 0.5
"""Hysteresis: warmed replicas are retired once the saving falls below this fraction of ``min_saving_ms_per_s``."""
FORGET_RATE_PER_S = 0.01
"""Prefixes whose decayed rate fell below this (about one request per 100 s) are forgotten."""
MAX_TRACKED = 10_000
"""Bound on tracked prefixes; beyond it the coldest are forgotten."""

PrefixKey = Hashable
"""The prefix index's chain key of the deepest matched block (opaque here)."""


@dataclass(frozen=True, slots=True)
class Warmup:
    """Warm ``target`` with the ``prefix_tokens``-token prefix ``prefix_key``."""

    prefix_key: PrefixKey
    prefix_tokens: int
    target: str
    via: Literal["prefill", "transfer"]
    """``prefill``: a background prefill-only request (max_tokens 1); ``transfer``: pull the KV from ``source``."""
    source: str | None
    """The least-busy holder (the transfer's source; for a prefill warm-up, where the prompt's tokens live)."""
    reason: str
    saving_ms_per_s: float
    """Decayed request rate × prefill each request saves: the prefix's heat."""


@dataclass(frozen=True, slots=True)
class Retired:
    """Replicas warmed for ``prefix_key`` that are no longer counted as its targets."""

    prefix_key: PrefixKey
    replicas: frozenset[str]
    reason: str


@dataclass(slots=True)
class _Prefix:
    tokens: int
    rate: DecayedRate
    holders: frozenset[str]
    last_used_s: float
    warmed: set[str] = field(default_factory=set)
    """Replicas this planner warmed for the prefix, reported by :meth:`HotPrefixTracker.retire` when it cools."""
    pending: tuple[str, float, bool] | None = None
    """A warm-up in flight: (target, deadline, whether this planner started it or a peer gateway did)."""


class HotPrefixTracker:
    """Tracks per prefix a decayed request rate and plans warm-ups for the hot ones.

    Rate: a :class:`policies.rate.DecayedRate` of the prefix's requests (half-life ``half_life_s``).
    Heat: ``rate × (prefill_ms(prefix) − fixed_ms)`` — the prefill every request avoids when it lands on a holder.

    The same rates, with each prefix's last request time, tell what each replica's cache is worth at the margin
    (:meth:`cache_margins`), so the tracker records prefixes whether or not replication is enabled.

    A prefix gets one more replica when all of these hold:

    * heat ≥ ``min_saving_ms_per_s`` and the prefix has ≥ ``min_prefix_tokens`` tokens;
    * every healthy holder's queue delay exceeds the best non-holder's ``queue delay + prefill_ms(prefix)`` plus the
      prefill lost to what the copy evicts there (:func:`policies.capacity.eviction_ms`; the holders are the
      bottleneck: requests would rather recompute elsewhere than wait);
    * routable holders (as the prefix index reports them) < ``max_replicas_per_prefix``: a draining holder keeps
      its cache in the index (a transfer may pull it) but serves none of the prefix's traffic;
    * no warm-up of this prefix is in flight, from this planner or a peer gateway's (:meth:`peer_warmup`), until its
      target shows up as a holder, the router reports it finished, or ``warmup_timeout_s`` passes;
    * the token bucket holds the prefix's tokens: ``warmup_budget_tokens_per_s`` (one second of burst) is the
      fleet's, so ``gateways`` planners each take their share.

    Within one planning round, a target's queue grows by each warm-up planned onto it, so one idle replica is not
    handed every hot prefix at once.

    ``via="transfer"`` when a KV connector is configured, the prefix is at least ``transfer.min_tokens`` long, and
    moving it costs less than prefilling it on the target (setup + bytes/bandwidth + one engine step versus
    ``prefill_ms``): the target's GPU time is what a warm-up spends.

    When the heat falls below ``RETIRE_FRACTION × min_saving_ms_per_s``, the warmed replicas stop being counted
    (:meth:`retire` reports them); engine LRU reclaims their blocks as traffic moves on. ``counts`` holds
    started / retired / skipped counters by reason, for metrics.
    """

    def __init__(self, config: ReplicationConfig) -> None:
        self.config = config
        self._prefixes: dict[PrefixKey, _Prefix] = {}
        self._budget_tokens = config.warmup_budget_tokens_per_s
        self._budget_updated: float | None = None
        self.counts: Counter[tuple[str, str]] = Counter()
        """(event, reason) → count; events ``started``, ``retired``, ``failed`` (timeout / reported) and ``skipped``
        (hot prefixes passed over in a planning round: ``cap``, ``budget``)."""

    def __len__(self) -> int:
        return len(self._prefixes)

    def record(self, prefix_key: PrefixKey, prefix_tokens: int, holders: set[str] | frozenset[str], now: float) -> None:
        """One request matched this prefix, held by ``holders`` (from the prefix index) at time ``now`` (s)."""
        if prefix_tokens <= 0:
            return
        entry = self._prefixes.get(prefix_key)
        if entry is None:
            if len(self._prefixes) >= MAX_TRACKED:
                self._forget_coldest(now)
            entry = _Prefix(tokens=prefix_tokens, rate=DecayedRate(self.config.half_life_s), holders=frozenset(holders),
                            last_used_s=now)
            self._prefixes[prefix_key] = entry
        entry.rate.add(now)
        entry.tokens = prefix_tokens
        entry.holders = frozenset(holders)
        entry.last_used_s = max(entry.last_used_s, now)
        if entry.pending is not None and entry.pending[0] in entry.holders:
            entry.pending = None

    def peer_warmup(self, prefix_key: PrefixKey, target: str, now: float) -> bool:
        """A peer gateway started warming ``target`` with this prefix: plan no other warm-up of it until the target
        holds it or ``warmup_timeout_s`` passes. False when this planner does not track the prefix, or already has
        a warm-up of it in flight."""
        entry = self._prefixes.get(prefix_key)
        if entry is None or target in entry.holders or (entry.pending is not None and now < entry.pending[1]):
            return False
        entry.pending = (target, now + self.config.warmup_timeout_s, False)
        return True

    def warmup_finished(self, prefix_key: PrefixKey, target: str, ok: bool) -> None:
        """The router's report on a warm-up it ran; a failed one frees its slot for another target."""
        entry = self._prefixes.get(prefix_key)
        if entry is None or entry.pending is None or entry.pending[0] != target or not entry.pending[2]:
            return
        entry.pending = None
        if not ok:
            entry.warmed.discard(target)
            self.counts[("failed", "reported")] += 1

    def heat_ms_per_s(self, prefix_key: PrefixKey, cost_model: CostModel, now: float) -> float:
        entry = self._prefixes.get(prefix_key)
        return 0.0 if entry is None else self._heat(entry, cost_model, now)

    def cache_margins(
        self, holds: Callable[[str, PrefixKey], bool], cost_model: CostModel, now: float
    ) -> dict[str, CacheMargin]:
        """Per replica, its cache's value at the margin (:func:`policies.capacity.cache_margin`) from the tracked
        prefixes it still holds. ``holds(replica, key)`` is the prefix index's answer: the holders recorded with a
        prefix are as of its last request, and the replica may have evicted it since."""
        held: dict[str, list[HeldPrefix]] = {}
        for key, entry in self._prefixes.items():
            holders = [h for h in entry.holders if holds(h, key)]
            if not holders:
                continue
            prefix = HeldPrefix(entry.tokens, entry.rate.per_s(now), entry.last_used_s, len(holders))
            for h in holders:
                held.setdefault(h, []).append(prefix)
        per_token = cost_model.prefill.per_token_ms
        margins = {name: cache_margin(prefixes, per_token, now) for name, prefixes in held.items()}
        return {name: margin for name, margin in margins.items() if margin is not None}

    def retire(self, cost_model: CostModel, now: float) -> list[Retired]:
        """Stop counting warmed replicas of prefixes that cooled down; forget prefixes nobody asks for."""
        retired = []
        threshold = self.config.min_saving_ms_per_s * RETIRE_FRACTION
        for key, entry in list(self._prefixes.items()):
            heat = self._heat(entry, cost_model, now)
            if entry.warmed and heat < threshold:
                retired.append(Retired(key, frozenset(entry.warmed), "cooled"))
                self.counts[("retired", "cooled")] += 1
                entry.warmed.clear()
                entry.pending = None
            if entry.rate.per_s(now) < FORGET_RATE_PER_S and not entry.warmed:
                del self._prefixes[key]
        return retired

    def plan(self, views: Sequence[ReplicaView], cost_model: CostModel, now: float, gateways: int = 1) -> list[Warmup]:
        """Warm-ups to start now, hottest prefix first; ``gateways`` planners share the budget."""
        if not self.config.enabled:
            return []
        self._refill(now, max(gateways, 1))
        queues = {v.name: cost_model.queue_delay_ms(v) for v in views if v.healthy}
        by_name = {v.name: v for v in views}
        hot = []
        for key, entry in self._prefixes.items():
            heat = self._heat(entry, cost_model, now)
            if heat >= self.config.min_saving_ms_per_s and entry.tokens >= self.config.min_prefix_tokens:
                hot.append((heat, key, entry))
        hot.sort(key=lambda item: item[0], reverse=True)
        warmups = []
        for heat, key, entry in hot:
            warmup = self._plan_one(key, entry, heat, queues, by_name, cost_model, now)
            if warmup is not None:
                warmups.append(warmup)
                queues[warmup.target] += self._target_ms(warmup, cost_model)
        return warmups

    def _plan_one(
        self,
        key: PrefixKey,
        entry: _Prefix,
        heat: float,
        queues: dict[str, float],
        views: Mapping[str, ReplicaView],
        cost_model: CostModel,
        now: float,
    ) -> Warmup | None:
        if entry.pending is not None:
            target, deadline, own = entry.pending
            if now < deadline:
                return None
            entry.pending = None
            if own:
                entry.warmed.discard(target)
                self.counts[("failed", "timeout")] += 1
        holders = [h for h in entry.holders if h in queues]
        if not holders:
            return None
        if len(holders) >= self.config.max_replicas_per_prefix:
            self.counts[("skipped", "cap")] += 1
            return None
        source = min(holders, key=lambda h: queues[h])
        recompute = cost_model.prefill_ms(entry.tokens)
        targets = [n for n in queues if n not in entry.holders and views[n].role != "prefill"]
        if not targets:
            return None
        cost = {n: queues[n] + eviction_ms(views[n], entry.tokens) for n in targets}
        target = min(targets, key=cost.__getitem__)
        if queues[source] <= cost[target] + recompute:
            return None
        if self._budget_tokens < entry.tokens:
            self.counts[("skipped", "budget")] += 1
            return None
        self._budget_tokens -= entry.tokens
        # a first leg runs only on a replica of role both: prefill replicas serve disaggregated requests' legs
        # alone, and decode replicas never run one
        via = self._via(entry.tokens, cost_model) if views[source].role == "both" else "prefill"
        entry.warmed.add(target)
        entry.pending = (target, now + self.config.warmup_timeout_s, True)
        self.counts[("started", "hot-prefix")] += 1
        return Warmup(key, entry.tokens, target, via, source, "hot-prefix", heat)

    @classmethod
    def _via(cls, tokens: int, cost_model: CostModel) -> Literal["prefill", "transfer"]:
        transfer = cost_model.transfer
        if not cost_model.transfer_enabled or tokens < transfer.min_tokens:
            return "prefill"
        return "transfer" if cls._pull_ms(tokens, cost_model) < cost_model.prefill_ms(tokens) else "prefill"

    @classmethod
    def _target_ms(cls, warmup: Warmup, cost_model: CostModel) -> float:
        """The target's time a warm-up takes."""
        if warmup.via == "transfer":
            return cls._pull_ms(warmup.prefix_tokens, cost_model)
        return cost_model.prefill_ms(warmup.prefix_tokens)

    @staticmethod
    def _pull_ms(tokens: int, cost_model: CostModel) -> float:
        """Pulling ``tokens`` of KV onto the target, and its one engine step."""
        return cost_model.wire_ms(tokens) + cost_model.prefill.fixed_ms

    def _heat(self, entry: _Prefix, cost_model: CostModel, now: float) -> float:
        saved = cost_model.prefill_ms(entry.tokens) - cost_model.prefill.fixed_ms
        return entry.rate.per_s(now) * saved

    def _refill(self, now: float, gateways: int) -> None:
        capacity = self.config.warmup_budget_tokens_per_s / gateways
        self._budget_tokens = min(self._budget_tokens, capacity)
        if self._budget_updated is not None and now > self._budget_updated:
            self._budget_tokens = min(capacity, self._budget_tokens + capacity * (now - self._budget_updated))
        self._budget_updated = now if self._budget_updated is None else max(now, self._budget_updated)

    def _forget_coldest(self, now: float) -> None:
        """Drop the coldest tenth of the tracked prefixes (never ones with warmed replicas)."""
        coldest = sorted((k for k, e in self._prefixes.items() if not e.warmed), key=lambda k: self._prefixes[k].rate.per_s(now))
        for key in coldest[: max(1, len(coldest) // 10)]:
            del self._prefixes[key]
