"""The ``cost`` policy (default): route each request where its predicted time to first token is lowest."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from kvgate.policies.base import Decision, ReplicaView, RouteRequest
from kvgate.policies.capacity import copy_eviction_ms
from kvgate.policies.config import CostPolicyConfig, DisaggregationConfig
from kvgate.policies.cost_model import CostModel, Estimate, TransferEstimate
from kvgate.policies.disaggregation import decode_target, has_prefill_replicas, prefill_candidates
from kvgate.policies.explain import replica_numbers
from kvgate.policies.load import eligible, expected_arrival_rates, replica_load


@dataclass(slots=True)
class _Candidate:
    view: ReplicaView
    """The replica that serves the request (the transfer's destination for a transfer)."""
    ttft_ms: float
    score_ms: float
    """What candidates are compared on: ``ttft_ms`` plus ``interference_ms`` and ``eviction_ms`` (weighted) and
    ``session_ms``, minus the session bonus."""
    work_ms: float
    """Prefill the fleet spends on this candidate (uncached tokens; for a transfer, the source's leg)."""
    interference_ms: float
    """Delay ``work_ms`` imposes on other requests arriving where it runs (:meth:`CostModel.interference_ms`)."""
    eviction_ms: float
    """Prefill the fleet loses to what the candidate's copy evicts (:func:`policies.capacity.copy_eviction_ms`)."""
    transfer: TransferEstimate | None = None
    """The handoff: a warm transfer's, or a disaggregated request's (``disaggregated``)."""
    stall_ms: float = 0.0
    """Delay the candidate's prefill puts on the sequences decoding where it runs (fleets with prefill replicas)."""
    disaggregated: bool = False
    session_ms: float = 0.0
    """What a new session's later turns cost the fleet on this replica (:meth:`CostModel.session_load_ms`)."""

    def as_dict(self) -> dict[str, object]:
        """One alternative for explain."""
        row: dict[str, object] = {
            "kind": "disaggregated" if self.disaggregated else "transfer" if self.transfer else "local",
            "replica": self.view.name,
            "decoding": CostModel.decoding(self.view),
            "predicted_ttft_ms": self.ttft_ms,
            "interference_ms": self.interference_ms,
            "decode_stall_ms": self.stall_ms,
            "eviction_ms": self.eviction_ms,
            "session_load_ms": self.session_ms,
            "score_ms": self.score_ms,
        }
        if self.transfer is not None:
            row["prefill_replica" if self.disaggregated else "source"] = self.transfer.source
            row["handoff"] = self.transfer.as_dict()
        return row


class CostPolicy:
    """Per eligible replica, predict TTFT = queue delay + lower-tier load + prefill of the uncached tokens
    (:class:`policies.cost_model.CostModel`); when a KV connector is configured, also predict pulling the longest
    prefix any replica can source (routable or draining, see ``ReplicaView.can_source``) to each other replica.
    Candidates are compared on predicted TTFT plus the delay their prefill imposes on the requests that will arrive
    at that replica while it waits and runs there (``interference_weight`` × :meth:`CostModel.interference_ms`):
    what the benchmark and the fleet's users feel is the mean TTFT over all requests, not this one's alone. Without
    it, a request whose holder is briefly busy recomputes a long prefix on an idle replica to save itself a few
    milliseconds and holds up that replica's next arrivals for far longer. Also added (``eviction_weight``): the
    prefill the fleet will lose to the evictions a candidate's copy causes on a full replica
    (:mod:`policies.capacity`) — a second copy of a long document is not free when it displaces another document
    someone will ask for again. Only the copy is
    priced, the blocks beyond the fewest any candidate must store (:func:`policies.capacity.copy_eviction_ms`). Pick
    the minimum. A transfer from a routable source never
    beats routing to that source (its first leg waits in the same queue); it wins when the warm replica takes no new
    requests — a drained replica's long prefix is pulled instead of recomputed — and loses to recompute for short
    prefixes, where link setup dominates.

    A request that starts a session (``RouteRequest.new_session``) also pays, on each candidate, what its later turns
    will cost the fleet there (``session_turns_ahead`` turns, :meth:`CostModel.session_load_ms`): they follow their
    cache to the replica chosen now, so a first turn that is a little cheaper where a shared system prompt is warm
    is not worth a session's worth of turns queued on the busiest replicas while others stand idle.

    Near-ties — candidates within ``max(tie_margin × best, tie_margin_ms)`` of the best — go to the one that spends
    the least prefill (most of the prompt cached), then the least-loaded one, a plain route before a transfer, then
    at random. Least work first: when waiting on a holder costs the request about what recomputing elsewhere would,
    recomputing only burns another replica's time (a 30k-token document re-prefilled on every idle replica while
    its holder finishes the first copy); equal cold replicas still share the traffic by load and at random, so
    several routers seeing the same fleet do not all herd onto the same replica.

    Reasons: ``transfer``; ``warm`` (the chosen replica holds part of the prompt); ``idle-recompute`` (another
    replica holds more of it, but waiting there costs more than recomputing here); ``cold`` (no routable replica
    holds any of it); ``session`` (the session bonus alone made the choice); ``new-session`` (pricing a new session's
    later turns alone made the choice).

    In a fleet with ``prefill``-role replicas (docs/disaggregation.md), each local candidate also pays the stall its
    prefill puts on the sequences decoding there (``decode_stall_weight`` × :meth:`CostModel.decode_stall_ms`), and
    each routable prefill replica adds a disaggregated candidate: prefill there (cache-aware), hand the KV to the
    decode replica chosen by load (:mod:`policies.disaggregation`), priced by :meth:`CostModel.handoff_estimate`.
    ``disaggregation.mode`` says which compete: all (``cost``), only the disaggregated (``always``), or by the
    uncached tokens on the best local replica (``threshold``). Reasons there: ``disaggregated`` or ``local`` (and
    ``transfer``).

    Parameters (``policy.cost``):
        tie_margin: 0.05 — near-tie fraction of the best predicted TTFT.
        tie_margin_ms: 5 — absolute near-tie margin, so millisecond differences do not split hairs.
        session_bonus_ms: 10 — credited to the replica that last served the request's session: a soft hint that
            only decides between near-equal candidates, never a pin.
        session_turns_ahead: 4 — later turns a new session's placement is priced for; 0 prices its first turn alone.
        approximate_match_weight: 0.5 — matches from approximate token ids are credited at this fraction, and
            approximate requests are never transferred (the prefix they would move may not be theirs).
        interference_weight: 1 — weight of the delay a candidate's prefill imposes on its replica's other arrivals.
        eviction_weight: 1 — weight of the prefill lost to what a candidate's copy evicts.
        decode_stall_weight: 1 — weight of the stall a local prefill puts on running decodes (fleets with prefill
            replicas only).
        disaggregation: ``mode`` (cost, always, threshold) and ``threshold_tokens``.
        cost_model: the prefill / queue / transfer estimates (its coefficients may be swapped by calibration).
        rng: the tie-break randomness (unseeded by default, so separate routers break ties differently).
    """

    name: ClassVar[str] = "cost"

    def __init__(
        self, config: CostPolicyConfig, cost_model: CostModel, rng: random.Random,
        disaggregation: DisaggregationConfig = DisaggregationConfig(),
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        self._rng = rng
        self.disaggregation = disaggregation

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView], explain: bool = False) -> Decision:
        cfg = self.config
        model = self.cost_model
        views = eligible(replicas)
        weight = cfg.approximate_match_weight if request.approximate else 1.0
        queues = {v.name: model.queue_delay_ms(v) for v in views}
        estimates = {v.name: model.estimate(request, v, weight, queues[v.name]) for v in views}
        rates = expected_arrival_rates(views, {name: e.cached_tokens for name, e in estimates.items()})
        least_new = min(e.new_tokens for e in estimates.values())
        split = has_prefill_replicas(replicas)
        candidates = []
        for v in views:
            e = estimates[v.name]
            candidates.append(self._candidate(
                v, e.ttft_ms, e.prefill_ms, self._interference(rates[v.name], e.prefill_ms, queues[v.name]),
                self._eviction(v, e.new_tokens, least_new), None, self._stall(v, e.prefill_ms) if split else 0.0,
            ))
        source = None
        if model.transfer_enabled and not request.approximate:
            source = self._transfer_source(replicas, queues)
        if source is not None:
            candidates += self._transfer_candidates(request, source, views, estimates, queues, rates, least_new)
        placement = self._session_placement(request, views, estimates)
        self._price_placement(candidates, placement)
        alternatives = candidates
        if split:
            disaggregated = self._disaggregated_candidates(request, replicas, views, queues, rates, least_new)
            self._price_placement(disaggregated, placement)
            alternatives = candidates + disaggregated
            candidates = self._by_mode(candidates, disaggregated, estimates)

        best_score = min(c.score_ms for c in candidates)
        margin = max(best_score * cfg.tie_margin, cfg.tie_margin_ms)
        near = [c for c in candidates if c.score_ms <= best_score + margin]
        least_work = min(c.work_ms for c in near)
        near = [c for c in near if c.work_ms == least_work]
        if len(near) > 1:
            loads = [replica_load(c.view) for c in near]
            lowest_load = min(loads)
            near = [c for c, load in zip(near, loads) if load == lowest_load]
        if any(c.transfer is None for c in near):
            near = [c for c in near if c.transfer is None]
        chosen = self._rng.choice(near)
        local = chosen.transfer is None and not chosen.disaggregated

        details: dict[str, object] = {}
        if explain:
            details = self._details(
                request, replicas, views, estimates, candidates, chosen, source, queues, rates, least_new, placement
            )
            if split:
                details["disaggregation"] = self._split_details(replicas, alternatives, queues)
        return Decision(
            replica=chosen.view.name,
            action="disaggregate" if chosen.disaggregated else "route" if chosen.transfer is None else "transfer",
            reason=self._reason(chosen, candidates, estimates, margin, split),
            source=chosen.transfer.source if chosen.transfer else None,
            # a failed decode leg is retried elsewhere as a local prefill: the others are ranked by their local scores
            ranked=self._ranked(chosen, [c for c in alternatives if not c.disaggregated] if split else candidates),
            details=details,
            ttft_ms={name: e.ttft_ms for name, e in estimates.items()},
            load_ms=estimates[chosen.view.name].load_ms if local else None,
            interference_ms=chosen.interference_ms if local else None,
        )

    def _candidate(
        self,
        view: ReplicaView,
        ttft_ms: float,
        work_ms: float,
        interference_ms: float,
        eviction: float,
        transfer: TransferEstimate | None,
        stall_ms: float = 0.0,
        disaggregated: bool = False,
    ) -> _Candidate:
        cfg = self.config
        bonus = cfg.session_bonus_ms if view.last_session_match else 0.0
        score = (ttft_ms + cfg.interference_weight * interference_ms + cfg.eviction_weight * eviction
                 + cfg.decode_stall_weight * stall_ms - bonus)
        return _Candidate(view, ttft_ms, score, work_ms, interference_ms, eviction, transfer, stall_ms, disaggregated)

    def _session_placement(
        self, request: RouteRequest, views: list[ReplicaView], estimates: dict[str, Estimate]
    ) -> dict[str, float]:
        """For a request that starts a session, per replica: what its later turns cost the fleet there. A later
        turn's prefill is taken to be this one's own part, the tokens beyond the longest prefix any replica holds
        (the shared part a later turn finds cached wherever the session goes); the load is the replica's own
        arrival rate, not the expected one: the session's turns are the arrivals a copy would bring. The turns are
        ``session_turns_ahead`` times the share of the tenant's sessions that come back at all."""
        turns = self.config.session_turns_ahead * request.session_return_share
        if not request.new_session or not turns:
            return {}
        shared = max(e.cached_tokens for e in estimates.values())
        turn_ms = self.cost_model.prefill_ms(request.prompt_tokens - shared, context=shared)
        return {v.name: self.cost_model.session_load_ms(v.arrival_rate_per_s, turn_ms, turns) for v in views}

    @staticmethod
    def _price_placement(candidates: list[_Candidate], placement: dict[str, float]) -> None:
        if placement:
            for c in candidates:
                c.session_ms = placement.get(c.view.name, 0.0)
                c.score_ms += c.session_ms

    def _stall(self, view: ReplicaView, work_ms: float) -> float:
        return self.cost_model.decode_stall_ms(view, work_ms) if self.config.decode_stall_weight else 0.0

    def _disaggregated_candidates(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        views: list[ReplicaView],
        queues: dict[str, float],
        rates: dict[str, float],
        least_new: int,
    ) -> list[_Candidate]:
        """Prefill on each prefill replica that may (its queue, then the prompt tokens it lacks: cache-aware), hand
        the KV to the decode replica (:func:`policies.disaggregation.decode_target`). The prefill replica's prefill
        holds up its own next arrivals (interference) but no decodes; the decode replica's admission step stalls
        its running decodes for one step."""
        decode = decode_target(views)
        if decode is None:
            return []
        found = []
        for prefill in prefill_candidates(replicas, decode):
            if prefill.name not in queues:
                queues[prefill.name] = self.cost_model.queue_delay_ms(prefill)
            estimate = self.cost_model.handoff_estimate(
                request, prefill, decode, queues[prefill.name], queues[decode.name]
            )
            interference = self._interference(
                prefill.arrival_rate_per_s, estimate.source_prefill_ms, queues[prefill.name]
            ) + self._interference(rates[decode.name], estimate.dest_step_ms, queues[decode.name])
            found.append(self._candidate(
                decode, estimate.ms, estimate.source_prefill_ms + estimate.dest_step_ms, interference,
                self._eviction(decode, estimate.tokens, least_new), estimate,
                self._stall(decode, estimate.dest_step_ms), True,
            ))
        return found

    def _by_mode(
        self, candidates: list[_Candidate], disaggregated: list[_Candidate], estimates: dict[str, Estimate]
    ) -> list[_Candidate]:
        """The alternatives the mode lets compete: all of them (``cost``); only the disaggregated ones (``always``);
        or, for ``threshold``, the disaggregated ones when the uncached tokens on the best local replica reach
        ``threshold_tokens``, else the local ones. With no prefill replica routable, the local ones."""
        mode = self.disaggregation.mode
        if not disaggregated:
            return candidates
        if mode == "always":
            return disaggregated
        if mode == "threshold":
            local = min(candidates, key=lambda c: c.score_ms)
            if estimates[local.view.name].new_tokens >= self.disaggregation.threshold_tokens:
                return disaggregated
            return candidates
        return candidates + disaggregated

    def _interference(self, arrival_rate_per_s: float, work_ms: float, wait_ms: float = 0.0) -> float:
        if not self.config.interference_weight:
            return 0.0
        return self.cost_model.interference_ms(arrival_rate_per_s, work_ms, wait_ms)

    def _eviction(self, view: ReplicaView, new_tokens: int, least_new: int) -> float:
        return copy_eviction_ms(view, new_tokens, least_new) if self.config.eviction_weight else 0.0

    def _transfer_source(self, replicas: Sequence[ReplicaView], queues: dict[str, float]) -> ReplicaView | None:
        """The replica holding the longest prefix among those that can serve a first leg (least queued on a tie),
        routable or not: a draining replica's cache is still there to be pulled. Only a replica of role ``both``:
        a decode replica never runs a first leg, and a prefill replica's are priced as disaggregation. Its queue delay is added to
        ``queues`` when the policy did not already compute it (it is not a routing candidate)."""
        sources = [v for v in replicas if v.can_source and v.match.total > 0 and v.role == "both"]
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
        rates: dict[str, float],
        least_new: int,
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
                source_rate = rates.get(source.name, source.arrival_rate_per_s)  # a draining source is not eligible
                interference = self._interference(
                    source_rate, estimate.source_prefill_ms, queues[source.name]
                ) + self._interference(rates[dest.name], estimate.dest_step_ms, queues[dest.name])
                eviction = self._eviction(dest, estimate.tokens, least_new)
                found.append(self._candidate(dest, estimate.ms, work, interference, eviction, estimate))
        return found

    def _reason(
        self, chosen: _Candidate, candidates: list[_Candidate], estimates: dict[str, Estimate], margin: float,
        split: bool,
    ) -> str:
        if chosen.disaggregated:
            return "disaggregated"
        if chosen.transfer is not None:
            return "transfer"
        if split:
            return "local"
        if any(c.session_ms for c in candidates):
            unplaced = [c.score_ms - c.session_ms for c in candidates if c is not chosen]
            if unplaced and chosen.score_ms - chosen.session_ms > min(unplaced) + margin:
                return "new-session"  # pricing the session's later turns alone made the choice
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
        seen = {chosen.view.name}
        for c in sorted(candidates, key=lambda c: c.score_ms):
            if c.view.name not in seen:
                seen.add(c.view.name)
                ranked.append(c.view.name)
        return ranked

    def _details(
        self,
        request: RouteRequest,
        fleet: Sequence[ReplicaView],
        views: list[ReplicaView],
        estimates: dict[str, Estimate],
        candidates: list[_Candidate],
        chosen: _Candidate,
        source: ReplicaView | None,
        queues: dict[str, float],
        rates: dict[str, float],
        least_new: int,
        placement: dict[str, float],
    ) -> dict[str, object]:
        """Per-replica rows for the routing candidates, plus the transfer source's when it is not one of them
        (draining: its queue and cache are what the transfers were priced from) and the prefill replicas'."""
        replicas = {
            v.name: replica_numbers(v, estimates[v.name], rates[v.name], self.cost_model, least_new) for v in views
        }
        # the transfer source and the prefill replicas are not routing candidates: their rows price a prefill there
        others = [source] if source is not None else []
        others += [v for v in fleet if v.role == "prefill"]
        for other in others:
            if other.name not in replicas:
                estimate = self.cost_model.estimate(request, other, queue_delay_ms=queues.get(other.name))
                replicas[other.name] = replica_numbers(
                    other, estimate, other.arrival_rate_per_s, self.cost_model, least_new
                )
        for name, session_ms in placement.items():
            replicas[name]["session_load_ms"] = session_ms
        details: dict[str, object] = {"replicas": replicas}
        transfers = [c.transfer.as_dict() for c in candidates if c.transfer is not None and not c.disaggregated]
        if transfers:
            details["transfers"] = transfers
        if chosen.transfer is not None:
            details["transfer"] = chosen.transfer.as_dict()
        return details

    def _split_details(
        self, replicas: Sequence[ReplicaView], alternatives: list[_Candidate], queues: dict[str, float]
    ) -> dict[str, object]:
        """Every alternative with its numbers, whether the mode let it compete or not: each local one (prefill where
        it decodes, with the stall that puts on the decodes running there), each warm transfer, and each
        disaggregated one (prefill on a prefill replica, decode on the decode replica)."""
        decode = next((c.view.name for c in alternatives if c.disaggregated), None)
        return {
            "mode": self.disaggregation.mode,
            "threshold_tokens": self.disaggregation.threshold_tokens,
            "decode_replica": decode,
            "prefill_replicas": {
                v.name: {"healthy": v.healthy, "queue_delay_ms": queues.get(v.name), "cached_tokens": v.match.total}
                for v in replicas if v.role == "prefill"
            },
            "alternatives": [c.as_dict() for c in alternatives],
        }
