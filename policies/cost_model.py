"""The service model behind the ``cost`` policy: what a request's time to first token will be on each replica.

docs/design.md ("The decision"): ``ttft(r) = queue_delay(r) + load of lower-tier hits + prefill_ms(uncached tokens)``.
Everything here is arithmetic on a :class:`ReplicaView` snapshot, cheap enough to run for every replica on every
request. The prefill coefficients are the policy file's (per model) and are swapped by the router when
:class:`policies.calibration.Calibrator` refines them (assign :attr:`CostModel.prefill`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import PolicyConfig, PrefillCost, TransferConfig

GIB = 1024**3
EULER_GAMMA = 0.5772156649015329


@dataclass(slots=True)
class Estimate:
    """Predicted time to first token of one request on one replica, and its parts (all in ms)."""

    queue_delay_ms: float
    prefill_ms: float
    """Prefill of the tokens the replica does not hold, including the per-request fixed cost."""
    load_ms: float
    """Loading the prefix tokens held in CPU / storage tiers back onto the GPU."""
    ttft_ms: float
    cached_tokens: int
    """Prompt tokens credited as cached (after the approximate-match weight), all tiers."""
    gpu_tokens: int
    """Of ``cached_tokens``, those on the GPU (or predicted there); the rest are loaded from the lower tiers."""
    cpu_tokens: int
    storage_tokens: int
    new_tokens: int = 0
    """Prompt tokens the replica computes and stores (not credited as cached)."""

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        return {"gpu": self.gpu_tokens, "cpu": self.cpu_tokens, "storage": self.storage_tokens}

    def as_dict(self) -> dict[str, object]:
        return {
            "queue_delay_ms": self.queue_delay_ms,
            "predicted_ttft_ms": self.ttft_ms,
            "prefill_ms": self.prefill_ms,
            "load_ms": self.load_ms,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_by_tier": self.cached_tokens_by_tier,
        }


@dataclass(slots=True)
class TransferEstimate:
    """Predicted TTFT of serving a request on ``dest`` with KV pulled from ``source`` (vLLM NixlConnector).

    The handshake is two requests in sequence: a prefill-only request on the source (it waits in the source's
    queue like any other, then prefills whatever the source does not hold), then the client's request on the
    destination, which waits in the destination's queue, pulls the KV blocks it lacks over the link and runs one
    engine step to produce the first token. Summing the legs is deliberately conservative: a transfer is the
    riskiest action (two replicas, a network link), so it must win clearly to be chosen.
    """

    source: str
    dest: str
    tokens: int
    """Prompt tokens whose KV crosses the link (everything the destination does not already hold)."""
    saved_tokens: int
    """Prefix tokens the destination gets without recomputing them anywhere (source's prefix beyond its own)."""
    bytes: int
    source_queue_ms: float
    source_prefill_ms: float
    wire_ms: float
    """Link setup + bytes / bandwidth."""
    dest_queue_ms: float
    dest_step_ms: float
    ms: float
    """The whole thing: the predicted time to first token."""

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "dest": self.dest,
            "tokens": self.tokens,
            "saved_tokens": self.saved_tokens,
            "bytes": self.bytes,
            "source_queue_ms": self.source_queue_ms,
            "source_prefill_ms": self.source_prefill_ms,
            "wire_ms": self.wire_ms,
            "dest_queue_ms": self.dest_queue_ms,
            "dest_step_ms": self.dest_step_ms,
            "predicted_ttft_ms": self.ms,
        }


class CostModel:
    """Prefill, queue-delay and transfer estimates for one model.

    Parameters:
        prefill: ``prefill_ms(n) = fixed_ms + per_token_ms·n + quadratic_ms·n²/1e6``.
        tier_load_ms_per_token: cost of using a token held in a lower tier (``"cpu"``, ``"storage"``) instead of
            the GPU; a tier missing here is credited as if it were recomputed.
        transfer: the KV link between replicas; transfers are estimated only when its connector is not ``"none"``.
        kv_bytes_per_token: KV size of one token (all layers), for transfer bytes.
        default_prompt_tokens: prompt length assumed for queued requests the router knows nothing about (other
            routers' traffic seen only in the engine's scraped waiting queue).
    """

    def __init__(
        self,
        prefill: PrefillCost,
        tier_load_ms_per_token: Mapping[str, float],
        transfer: TransferConfig,
        kv_bytes_per_token: int,
        default_prompt_tokens: int = 1024,
    ) -> None:
        self.prefill = prefill
        self.tier_load_ms_per_token = dict(tier_load_ms_per_token)
        self.transfer = transfer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.default_prompt_tokens = default_prompt_tokens

    @classmethod
    def from_config(
        cls, prefill: PrefillCost, kv_bytes_per_token: int, policy: PolicyConfig, transfer: TransferConfig
    ) -> "CostModel":
        """The cost model of a model's constants (its prefill cost and KV bytes per token), with the policy's
        lower-tier load costs and the KV link's."""
        return cls(prefill, policy.tier_load_ms_per_token, transfer, kv_bytes_per_token)

    @property
    def transfer_enabled(self) -> bool:
        return self.transfer.connector != "none"

    def prefill_avoided_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Prefill skipped because ``cached_tokens`` leading tokens of a ``prompt_tokens`` prompt were already held:
        the prefill of the whole prompt minus that of the uncached rest after the cached context. The engines do not
        report prefill time, so "what caching paid" is this, with the calibrated coefficients."""
        cached = max(0, min(cached_tokens, prompt_tokens))
        return self.prefill_ms(prompt_tokens) - self.prefill_ms(prompt_tokens - cached, context=cached)

    def prefill_ms(self, tokens: float, context: float = 0) -> float:
        """Prefill time of ``tokens`` new tokens after ``context`` cached ones.

        The fixed cost applies to every request (even a full cache hit runs one engine step). The quadratic
        term is attention's share: new tokens attend to the whole context, so it grows with
        ``(context + tokens)² − context²``.
        """
        p = self.prefill
        if tokens <= 0:
            return p.fixed_ms
        quadratic = p.quadratic_ms * ((context + tokens) ** 2 - context**2) / 1e6 if p.quadratic_ms else 0.0
        return p.fixed_ms + p.per_token_ms * tokens + quadratic

    def queue_delay_ms(self, view: ReplicaView) -> float:
        """How long a new request on ``view``'s replica waits before its prefill: the :meth:`work_ahead_ms` there
        times ``queue_scale`` (the calibrator's measure of how much of that work a new request really waits for)."""
        return self.prefill.queue_scale * self.work_ahead_ms(view)

    def work_ahead_ms(self, view: ReplicaView) -> float:
        """Work ahead of a new request on ``view``'s replica, in ms. Three parts:

        * the router's own requests still prefilling there (``in_flight_prefilling`` requests holding
          ``in_flight_prefill_tokens`` uncached tokens): each costs the fixed cost, all their tokens cost per-token
          (the quadratic term uses their mean length);
        * requests in the engine's scraped waiting queue beyond the router's own (other routers' traffic, or
          requests the router no longer tracks), each costed as a mean prefill: the router's own mean when it has
          requests there, else ``default_prompt_tokens``;
        * decode interference: a running sequence adds about ``decode_ms_per_token`` to every engine step, and the
          new request's prefill shares its step with them (small; zero when ``decode_ms_per_token`` is 0).

        Decoding requests do not otherwise block a prefill (continuous batching admits it at the next step).
        """
        p = self.prefill
        prefilling = view.in_flight_prefilling
        tokens = view.in_flight_prefill_tokens
        delay = 0.0
        mean_tokens: float = self.default_prompt_tokens
        if prefilling:
            mean_tokens = tokens / prefilling
            delay = prefilling * p.fixed_ms + p.per_token_ms * tokens
            if p.quadratic_ms:
                delay += p.quadratic_ms * tokens * tokens / (prefilling * 1e6)
        waiting = view.scraped_waiting
        if waiting is not None and waiting > prefilling:
            delay += (waiting - prefilling) * self.prefill_ms(mean_tokens)
        if p.decode_ms_per_token:
            running = view.scraped_running if view.scraped_running is not None else view.in_flight - prefilling
            delay += max(running, 0) * p.decode_ms_per_token
        return delay

    def kv_wait_ms(self, view: ReplicaView, need_tokens: int) -> float:
        """How long a request that needs ``need_tokens`` of free KV (its uncached prompt and its output) waits on
        ``view``'s replica for blocks, before any prefill: an engine starts a waiting request only once its blocks
        fit (vLLM's scheduler stops at the first waiting request it cannot allocate; the simulated fleet reserves
        prompt and output at admission), and the requests waiting there go first.

        Free KV is the scraped share not in use (cached blocks nothing references are evictable, so free). What is
        missing frees as running sequences finish: with ``R`` running and ``λ`` finishing a second (the replica's
        arrival rate, equal in a steady state), each holds about ``usage·capacity / R`` and stays ``R/λ`` on
        average, so the ``k`` finishes that free enough take ``(R/λ)·(H(R) − H(R−k))`` (exponential residences; H
        the harmonic numbers). At most all ``R``: a request bigger than what they hold waits for all of them.

        0 when it fits, or when the engine does not report its KV usage, capacity or running count (nothing to go
        on: the queue term still counts the work ahead). The queued requests' need is their mean prefill (the
        router's own prefilling mean, else ``default_prompt_tokens``).
        """
        usage, capacity, running = view.kv_usage, view.kv_capacity_tokens, view.scraped_running
        rate_per_s = view.arrival_rate_per_s
        if usage is None or not capacity or not running or rate_per_s <= 0:
            return 0.0
        usage = min(max(usage, 0.0), 1.0)
        waiting = view.scraped_waiting or 0
        mean_tokens = (view.in_flight_prefill_tokens / view.in_flight_prefilling if view.in_flight_prefilling
                       else self.default_prompt_tokens)
        deficit = waiting * mean_tokens + need_tokens - capacity * (1.0 - usage)
        if deficit <= 0:
            return 0.0
        held_per_sequence = usage * capacity / running
        finishes = running if held_per_sequence <= 0 else min(running, math.ceil(deficit / held_per_sequence))
        return 1000.0 * running / rate_per_s * (harmonic(running) - harmonic(running - finishes))

    @staticmethod
    def decoding(view: ReplicaView) -> int:
        """Sequences decoding on ``view``'s replica: the engine's scraped running requests (the router's own still
        prefilling aside), else the router's own past their first token."""
        prefilling = view.in_flight_prefilling
        running = view.scraped_running if view.scraped_running is not None else view.in_flight
        return max(running - prefilling, 0)

    @classmethod
    def decode_stall_ms(cls, view: ReplicaView, work_ms: float) -> float:
        """Delay that ``work_ms`` of prefill started on a replica adds to the sequences decoding there: with chunked
        prefill every step that carries a chunk takes that chunk's time, so each running sequence waits the whole
        prefill, once. What prefill/decode disaggregation exists to avoid."""
        return cls.decoding(view) * work_ms

    def interference_ms(self, arrival_rate_per_s: float, work_ms: float, wait_ms: float = 0.0) -> float:
        """Delay that ``work_ms`` of prefill, placed on a replica where it first waits ``wait_ms``, adds to the other
        requests arriving there: ``queue_scale · λ·work·(wait + work/2)`` (λ = the replica's expected arrival rate,
        :func:`policies.load.expected_arrival_rates`). The ``λ·wait`` requests that arrive while it waits line up
        behind it and wait all of it; the ``λ·work`` that arrive while it runs find it in the work ahead and wait
        half of it on average (the residual-work term of an M/G/1 queue). Under load, most of the requests a prefill
        holds up were behind it before it started.

        It is a queue delay, other requests', so it is scaled as the queue term is: by ``queue_scale``, the
        calibrator's measure of how much of the work ahead a request really waits for (an engine that batches the
        prefills it has admitted holds its next arrivals up less than one running them in turn), and the policy
        leans on it no more than on the queue term.

        The request's own TTFT does not show this cost, the fleet's mean TTFT does: recomputing a 4,000-token prefix
        (~160 ms) on an idle replica taking 2.5 requests/s holds up its next arrivals by ~30 ms in total, while a
        warm 250-token prefill there costs them ~1 ms.
        """
        return self.prefill.queue_scale * arrival_rate_per_s * work_ms * (wait_ms + work_ms / 2.0) / 1000.0

    def session_load_ms(self, arrival_rate_per_s: float, turn_ms: float, turns: float) -> float:
        """What ``turns`` later turns of a session, ``turn_ms`` of prefill each, cost the fleet on a replica taking
        ``arrival_rate_per_s`` other requests: a new session's placement is a commitment, its later turns follow
        their cache to the replica it starts on.

        Each turn adds to the replica's arrival stream, so it is priced at the marginal waiting cost of an M/G/1
        queue, the derivative of the total waiting time ``λ·W`` with respect to λ: ``W·(2 − ρ)/(1 − ρ)``, where
        ``W = queue_scale · λ·w²/(2(1 − ρ))`` is the wait one turn finds there and ``ρ = λ·w`` the replica's busy
        fraction (both taking the session's own turn ``w`` as the typical request). The turn's own wait and the wait
        it adds to everyone else's; at ``ρ`` near 1 both grow without bound, so ``ρ`` is capped at 0.95. An idle
        replica (λ = 0) costs nothing: the fleet's mean TTFT is lowest when sessions spread in proportion to spare
        capacity, which pricing each new session at its marginal cost does (the system optimum of a static
        assignment of streams to queues).
        """
        if turns <= 0 or arrival_rate_per_s <= 0:
            return 0.0
        rho = min(arrival_rate_per_s * turn_ms / 1000.0, 0.95)
        wait_ms = self.interference_ms(arrival_rate_per_s, turn_ms) / (1.0 - rho)
        return turns * wait_ms * (2.0 - rho) / (1.0 - rho)

    def estimate(
        self,
        request: RouteRequest,
        view: ReplicaView,
        match_weight: float = 1.0,
        queue_delay_ms: float | None = None,
    ) -> Estimate:
        """Predicted TTFT of ``request`` on ``view``'s replica.

        Cached tokens are credited per tier: GPU and predicted tokens (a just-routed prompt, about to be on the
        GPU) are free, CPU / storage tokens cost their load time. At most ``prompt_tokens - 1`` are credited:
        the engine always computes the last prompt token. ``match_weight`` < 1 discounts matches computed from
        approximate token ids. Callers that already computed the replica's queue delay may pass it in; the wait
        for KV this request's own size adds (:meth:`kv_wait_ms`) is added to it.
        """
        queue_ms = self.queue_delay_ms(view) if queue_delay_ms is None else queue_delay_ms
        match = view.match
        room = max(request.prompt_tokens - 1, 0)
        gpu = min(int((match.gpu + match.predicted) * match_weight), room)
        cpu = storage = 0
        load_ms = 0.0
        if match.cpu or match.storage:
            cpu = min(int(match.cpu * match_weight), room - gpu)
            storage = min(int(match.storage * match_weight), room - gpu - cpu)
            load_ms = self._load_ms(cpu, storage)
        cached = gpu + cpu + storage
        queue_ms += self.prefill.queue_scale * self.kv_wait_ms(view, need_tokens(request.prompt_tokens - cached,
                                                                                  request.max_tokens))
        prefill = self.prefill_ms(request.prompt_tokens - cached, context=cached)
        return Estimate(
            queue_delay_ms=queue_ms,
            prefill_ms=prefill,
            load_ms=load_ms,
            ttft_ms=queue_ms + load_ms + prefill,
            cached_tokens=cached,
            gpu_tokens=gpu,
            cpu_tokens=cpu,
            storage_tokens=storage,
            new_tokens=request.prompt_tokens - cached,
        )

    def _load_ms(self, cpu_tokens: int, storage_tokens: int) -> float:
        per_token = self.prefill.per_token_ms
        cpu_rate = self.tier_load_ms_per_token.get("cpu", per_token)
        storage_rate = self.tier_load_ms_per_token.get("storage", per_token)
        return cpu_tokens * cpu_rate + storage_tokens * storage_rate

    def wire_ms(self, tokens: int) -> float:
        """Moving ``tokens`` tokens of KV over the link: setup + bytes / bandwidth."""
        return self.transfer.setup_ms + tokens * self.kv_bytes_per_token / (self.transfer.bandwidth_gib_s * GIB) * 1000.0

    def transfer_estimate(
        self,
        request: RouteRequest,
        source: ReplicaView,
        dest: ReplicaView,
        source_queue_ms: float | None = None,
        dest_queue_ms: float | None = None,
    ) -> TransferEstimate | None:
        """Predicted TTFT of pulling ``source``'s cached prefix to ``dest`` (see :class:`TransferEstimate`).

        None when no connector is configured, the source cannot serve a first leg (``ReplicaView.can_source``:
        a draining source can) or is the destination, or the prefix the destination would gain is shorter than
        ``transfer.min_tokens`` (setup dominates). Callers that already computed the replicas' queue delays may pass
        them in.
        """
        if not self.transfer_enabled or not source.can_source or source.name == dest.name:
            return None
        room = max(request.prompt_tokens - 1, 0)
        saved = min(source.match.total, room) - min(dest.match.total, room)
        if saved <= 0 or saved < self.transfer.min_tokens:
            return None
        return self.handoff_estimate(request, source, dest, source_queue_ms, dest_queue_ms)

    def handoff_estimate(
        self,
        request: RouteRequest,
        source: ReplicaView,
        dest: ReplicaView,
        source_queue_ms: float | None = None,
        dest_queue_ms: float | None = None,
    ) -> TransferEstimate:
        """Predicted TTFT of prefilling ``request`` on ``source`` (its queue, then the tokens it lacks, lower tiers
        credited at their load cost) and handing the KV to ``dest`` (link setup + the bytes of every token ``dest``
        lacks / bandwidth, then ``dest``'s queue and one engine step): a warm transfer's price, and a disaggregated
        request's (``source`` a prefill replica that may hold nothing)."""
        room = max(request.prompt_tokens - 1, 0)
        source_cached = min(source.match.total, room)
        dest_cached = min(dest.match.total, room)
        src_queue = self.queue_delay_ms(source) if source_queue_ms is None else source_queue_ms
        dst_queue = self.queue_delay_ms(dest) if dest_queue_ms is None else dest_queue_ms
        source_prefill = self._load_ms(source.match.cpu, source.match.storage) + self.prefill_ms(
            request.prompt_tokens - source_cached, context=source_cached
        )
        tokens = request.prompt_tokens - dest_cached
        nbytes = tokens * self.kv_bytes_per_token
        wire = self.wire_ms(tokens)
        dest_step = self.prefill.fixed_ms
        return TransferEstimate(
            source=source.name,
            dest=dest.name,
            tokens=tokens,
            saved_tokens=max(source_cached - dest_cached, 0),
            bytes=nbytes,
            source_queue_ms=src_queue,
            source_prefill_ms=source_prefill,
            wire_ms=wire,
            dest_queue_ms=dst_queue,
            dest_step_ms=dest_step,
            ms=src_queue + source_prefill + wire + dst_queue + dest_step,
        )


def need_tokens(uncached_tokens: int, max_tokens: int | None) -> int:
    """The KV a request needs free to start (tokens): its uncached prompt and its output (``max_tokens``, 0 unset)."""
    return max(uncached_tokens, 0) + (max_tokens or 0)


def harmonic(n: int) -> float:
    """``H(n) = 1 + 1/2 + … + 1/n`` (0 for n ≤ 0); past 16 terms its asymptotic expansion, within 1e-7."""
    if n <= 0:
        return 0.0
    if n <= 16:
        return sum(1.0 / i for i in range(1, n + 1))
    return math.log(n) + EULER_GAMMA + 1.0 / (2 * n) - 1.0 / (12 * n * n)
