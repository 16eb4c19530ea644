"""The ``cost`` policy (default): route each request where its predicted time to first token is lowest."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from policies.base import Decision, ReplicaView, RouteRequest
from policies.config import CostPolicyConfig
from policies.cost_model import CostModel, Estimate, TransferEstimate
from policies.explain import replica_numbers
from policies.load import eligible, replica_load


@dataclass(slots=True)
class _Candidate:
    view: ReplicaView
    """The replica that serves the request (the transfer's destination for a transfer)."""
    ttft_ms: float
    score_ms: float
    """What candidates are compared on: ``ttft_ms`` plus ``interference_ms`` (weighted), minus the session bonus."""
    work_ms: float
    """Prefill the fleet spends on this candidate (uncached tokens; for a transfer, the source's leg)."""
    interference_ms: float
    """Delay ``work_ms`` imposes on other requests arriving where it runs (:meth:`CostModel.interference_ms`)."""
    load: int
    transfer: TransferEstimate | None = None


class CostPolicy:
    """Per eligible replica, predict TTFT = queue delay + lower-tier load + prefill of the uncached tokens
    (:class:`policies.cost_model.CostModel`); when a KV connector is configured, also predict pulling the longest
    prefix any replica can source (routable or draining, see ``ReplicaView.can_source``) to each other replica.
    Candidates are compared on predicted TTFT plus the delay their prefill imposes on the requests that will arrive
    at that replica while it runs (``interference_weight`` × :meth:`CostModel.interference_ms`): what the benchmark
    and the fleet's users feel is the mean TTFT over all requests, not this one's alone. Without it, a request
    whose holder is briefly busy recomputes a long prefix on an idle replica to save itself a few milliseconds and
    holds up that replica's next arrivals for far longer. Pick the minimum. A transfer from a routable source never
    beats routing to that source (its first leg waits in the same queue); it wins when the warm replica takes no new
    requests — a drained replica's long prefix is pulled instead of recomputed — and loses to recompute for short
    prefixes, where link setup dominates.

    Near-ties — candidates within ``max(tie_margin × best, tie_margin_ms)`` of the best — go to the one that spends
    the least prefill (most of the prompt cached), then the least-loaded one, a plain route before a transfer, then
    at random. Least work first: when waiting on a holder costs the request about what recomputing elsewhere would,
    recomputing only burns another replica's time (a 30k-token document re-prefilled on every idle replica while
    its holder finishes the first copy); equal cold replicas still share the traffic by load and at random, so
    several routers seeing the same fleet do not all herd onto the same replica.

    Reasons: ``transfer``; ``warm`` (the chosen replica holds part of the prompt); ``idle-recompute`` (another
    replica holds more of it, but waiting there costs more than recomputing here); ``cold`` (no routable replica
    holds any of it); ``session`` (the session bonus alone made the choice).

    Parameters (``policy.cost``):
        tie_margin: 0.05 — near-tie fraction of the best predicted TTFT.
        tie_margin_ms: 5 — absolute near-tie margin, so millisecond differences do not split hairs.
        session_bonus_ms: 10 — credited to the replica that last served the request's session: a soft hint that
            only decides between near-equal candidates, never a pin.
        approximate_match_weight: 0.5 — matches from approximate token ids are credited at this fraction, and
            approximate requests are never transferred (the prefix they would move may not be theirs).
        interference_weight: 1 — weight of the delay a candidate's prefill imposes on its replica's other arrivals.
        cost_model: the prefill / queue / transfer estimates (its coefficients may be swapped by calibration).
        rng: the tie-break randomness (unseeded by default, so separate routers break ties differently).
    """

    name: ClassVar[str] = "cost"

    def __init__(self, config: CostPolicyConfig, cost_model: CostModel, rng: random.Random) -> None:
        self.config = config
        self.cost_model = cost_model
        self._rng = rng

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        cfg = self.config
        model = self.cost_model
        views = eligible(replicas)
        weight = cfg.approximate_match_weight if request.approximate else 1.0
        queues = {v.name: model.queue_delay_ms(v) for v in views}
        estimates = {v.name: model.estimate(request, v, weight, queues[v.name]) for v in views}
        candidates = []
        for v in views:
            work = estimates[v.name].prefill_ms
            candidates.append(self._candidate(v, estimates[v.name].ttft_ms, work, self._interference(v, work), None))
        source = None
        if model.transfer_enabled and not request.approximate:
            source = self._transfer_source(replicas, queues)
        if source is not None:
            candidates += self._transfer_candidates(request, source, views, estimates, queues)

        best_score = min(c.score_ms for c in candidates)
        margin = max(best_score * cfg.tie_margin, cfg.tie_margin_ms)
        near = [c for c in candidates if c.score_ms <= best_score + margin]
        least_work = min(c.work_ms for c in near)
        near = [c for c in near if c.work_ms == least_work]
        lowest_load = min(c.load for c in near)
        near = [c for c in near if c.load == lowest_load]
        if any(c.transfer is None for c in near):
            near = [c for c in near if c.transfer is None]
        chosen = self._rng.choice(near)

        return Decision(
            replica=chosen.view.name,
            action="route" if chosen.transfer is None else "transfer",
            reason=self._reason(chosen, candidates, estimates, margin),
            source=chosen.transfer.source if chosen.transfer else None,
            ranked=self._ranked(chosen, candidates),
            details=self._details(request, views, estimates, candidates, chosen, source, queues) if explain else {},
        )

    def _candidate(
        self,
        view: ReplicaView,
        ttft_ms: float,
        work_ms: float,
        interference_ms: float,
        transfer: TransferEstimate | None,
    ) -> _Candidate:
        bonus = self.config.session_bonus_ms if view.last_session_match else 0.0
        score = ttft_ms + self.config.interference_weight * interference_ms - bonus
        return _Candidate(view, ttft_ms, score, work_ms, interference_ms, replica_load(view), transfer)

    def _interference(self, view: ReplicaView, work_ms: float) -> float:
        return self.cost_model.interference_ms(view, work_ms) if self.config.interference_weight else 0.0

    def _transfer_source(self, replicas: Sequence[ReplicaView], queues: dict[str, float]) -> ReplicaView | None:
        """The replica holding the longest prefix among those that can serve a first leg (least queued on a tie),
        routable or not: a draining replica's cache is still there to be pulled. Its queue delay is added to
        ``queues`` when the policy did not already compute it (it is not a routing candidate)."""
        sources = [v for v in replicas if v.can_source and v.match.total > 0]
        if not sources:
            return None
        for v in sources:
            if v.name not in queues:
                queues[v.name] = self.cost_model.queue_delay_ms(v)
        return max(sources, key=lambda v: (v.match.total, -queues[v.name]))

    def _transfer_candidates(
        self,
        request: RouteRequest,
        source: ReplicaView,
        views: list[ReplicaView],
        estimates: dict[str, Estimate],
        queues: dict[str, float],
    ) -> list[_Candidate]:
        """Pull ``source``'s prefix to each other routable replica, where that beats serving there by recompute.

        A transfer first runs the handshake on the source, so it never finishes before serving the request on a
        routable source itself would (plus link setup): destinations already faster than that are skipped
        unpriced. A source that takes no new requests (draining) sets no such floor.
        """
        source_route = estimates.get(source.name)
        floor_ms = 0.0 if source_route is None else source_route.ttft_ms + self.cost_model.transfer.setup_ms
        found = []
        for dest in views:
            if dest.name == source.name or estimates[dest.name].ttft_ms <= floor_ms:
                continue
            estimate = self.cost_model.transfer_estimate(
                request, source, dest, queues[source.name], queues[dest.name]
            )
            if estimate is not None and estimate.ms < estimates[dest.name].ttft_ms:
                work = estimate.source_prefill_ms + estimate.dest_step_ms
                interference = self._interference(source, estimate.source_prefill_ms) + self._interference(
                    dest, estimate.dest_step_ms
                )
                found.append(self._candidate(dest, estimate.ms, work, interference, estimate))
        return found

    def _reason(
        self, chosen: _Candidate, candidates: list[_Candidate], estimates: dict[str, Estimate], margin: float
    ) -> str:
        if chosen.transfer is not None:
            return "transfer"
        if chosen.view.last_session_match:
            unhinted = chosen.score_ms + self.config.session_bonus_ms
            others = [c.score_ms for c in candidates if c is not chosen]
            if others and unhinted > min(others) + margin:
                return "session"  # without its bonus, another candidate would have won
        cached = estimates[chosen.view.name].cached_tokens
        if cached > 0:
            return "warm"
        if any(e.cached_tokens > 0 for e in estimates.values()):
            return "idle-recompute"
        return "cold"

    @staticmethod
    def _ranked(chosen: _Candidate, candidates: list[_Candidate]) -> list[str]:
        ranked = [chosen.view.name]
        for c in sorted(candidates, key=lambda c: c.score_ms):
            if c.view.name not in ranked:
                ranked.append(c.view.name)
        return ranked

    def _details(
        self,
        request: RouteRequest,
        views: list[ReplicaView],
        estimates: dict[str, Estimate],
        candidates: list[_Candidate],
        chosen: _Candidate,
        source: ReplicaView | None,
        queues: dict[str, float],
    ) -> dict[str, object]:
        """Per-replica rows for the routing candidates, plus the transfer source's when it is not one of them
        (draining: its queue and cache are what the transfers were priced from)."""
        replicas = {v.name: replica_numbers(v, estimates[v.name]) for v in views}
        if source is not None and source.name not in replicas:
            estimate = self.cost_model.estimate(request, source, queue_delay_ms=queues[source.name])
            replicas[source.name] = replica_numbers(source, estimate)
        details: dict[str, object] = {"replicas": replicas}
        transfers = [c.transfer.as_dict() for c in candidates if c.transfer is not None]
        if transfers:
            details["transfers"] = transfers
        if chosen.transfer is not None:
            details["transfer"] = chosen.transfer.as_dict()
        return details
