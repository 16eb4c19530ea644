"""The gate every generation request passes after it is tokenized and before it is routed.

A tenant over one of its limits is refused with 429 (:mod:`kvgate.router.admission.limits`). When nothing waits for
the request's model and some replica could start it soon (:mod:`kvgate.router.admission.saturation`), it goes on at
once: with room in the fleet the gate costs a few comparisons. Otherwise it waits in the model's
:class:`~kvgate.router.admission.fair_queue.FairQueue`, and a release loop, running only while something waits,
lets the next one go each time a replica could start it (checked every ``POLL_S`` and whenever a request ends). The
released request is routed then, on the fleet as it is at that moment (late binding). A waiter past its band's
deadline is refused with 503 and ``Retry-After``; one whose client leaves is taken out at once; the queue's bounds
are checked on entry. A reload changes the knobs and keeps every waiter.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.router.admission.config import AdmissionConfig
from kvgate.router.admission.fair_queue import FairQueue, Waiter
from kvgate.router.admission.limits import TenantLimits
from kvgate.router.admission.saturation import Saturation
from kvgate.router.core.errors import ApiError
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.routing.model_state import ModelRouting

POLL_S = 0.005
"""How often the release loop looks at the fleet while requests wait: capacity frees when a prefill ends, which
nothing announces, so it is polled."""
FAIRNESS_HALF_LIFE_S = 30.0
"""Decay of the per-tenant released tokens that Jain's fairness index is computed over."""
NO_TENANT = "none"
"""The tenant label of requests without tenants."""
ACTIVE_S = 10.0
"""A tenant counts as active (owed its share, and the headroom kept for it) this long after its last request."""


@dataclass(slots=True)
class Ticket:
    """An admitted request's hold on its tenant's concurrency, given back once by :meth:`release`."""

    gate: AdmissionGate
    tenant: str | None
    band: int
    tokens: int = 0
    """Prompt tokens it holds of its tenant's share while in flight (0 until it is let through)."""
    avoid: frozenset[str] = frozenset()
    """Replicas it may not be routed to: the headroom kept for other tenants when it was let through."""
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.finished(self)


@dataclass(slots=True)
class Request:
    """What a waiter needs to be released: where it may run, and the model state its start is judged with."""

    candidates: list[str]
    routing: ModelRouting
    future: asyncio.Future[frozenset[str]]
    """Set, on release, to the replicas the request must leave to others (the headroom)."""


@dataclass(slots=True)
class Pending:
    """A request waiting in the queue: :meth:`wait` gives its ticket once it is released."""

    gate: AdmissionGate
    ticket: Ticket
    queue: FairQueue[Request]
    waiter: Waiter[Request]
    weight: float

    async def wait(self) -> Ticket:
        """Raises :class:`ApiError` (503) at the deadline; cancelled (the client left), the waiter is taken out."""
        gate, ticket, waiter = self.gate, self.ticket, self.waiter
        try:
            ticket.avoid = await waiter.item.future
        except asyncio.CancelledError:
            if not waiter.gone:
                self.queue.remove(waiter)
                gate.metrics.admission_refusals.labels("client_left").inc()
            ticket.release()
            raise
        except ApiError:
            ticket.release()
            raise
        label = ticket.tenant if ticket.tenant is not None else NO_TENANT
        gate.metrics.admission_wait.labels(str(ticket.band), label).observe(gate.clock() - waiter.enqueued_at)
        gate._fairness.add(label, max(waiter.tokens, 1) / self.weight, gate.clock())
        gate._let_through(ticket, waiter.tokens)
        return ticket


@dataclass(slots=True)
class _Fairness:
    """Weighted tokens released from the queue per tenant, decayed: the shares Jain's index is taken over."""

    shares: dict[str, float] = field(default_factory=dict)
    at: float = 0.0

    def add(self, tenant: str, weighted_tokens: float, now: float) -> None:
        self._decay(now)
        self.shares[tenant] = self.shares.get(tenant, 0.0) + weighted_tokens

    def index(self, now: float) -> float:
        self._decay(now)
        values = [v for v in self.shares.values() if v > 1e-9]
        if not values:
            return 1.0
        return sum(values) ** 2 / (len(values) * sum(v * v for v in values))

    def _decay(self, now: float) -> None:
        if now > self.at:
            factor = 0.5 ** ((now - self.at) / FAIRNESS_HALF_LIFE_S)
            self.shares = {k: v * factor for k, v in self.shares.items() if v * factor > 1e-6}
            self.at = now


class AdmissionGate:
    def __init__(
        self, config: AdmissionConfig, saturation: Saturation, metrics: GatewayMetrics,
        gateways: Callable[[], int] = lambda: 1, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.saturation = saturation
        self.metrics = metrics
        self.gateways = gateways
        """Gateways sharing the tenants' limits (this one and the peers it hears from)."""
        self.clock = clock
        self.limits = TenantLimits()
        self._queues: dict[str, FairQueue[Request]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._fairness = _Fairness()
        self._in_flight: dict[str | None, int] = {}
        """Prompt tokens of each tenant's requests let through and not yet answered."""
        self._seen: dict[str | None, float] = {}
        """When each tenant last asked: the tenants active now."""
        metrics.add_collector(_AdmissionCollector(self))

    def reconfigure(self, config: AdmissionConfig) -> None:
        """The new knobs apply to waiters from now on (their deadlines stay as set)."""
        self.config = config
        self._wakeup.set()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def enter(
        self, model: str, candidates: list[str], routing: ModelRouting, tenant: str | None, priority: int | None,
        prompt_tokens: int, size_bytes: int,
    ) -> Ticket | Pending:
        """The request's :class:`Ticket` when it may be routed now (released once it is answered), else its place
        in the queue, a :class:`Pending` to await. Raises :class:`ApiError` (429 over a limit, 503 queue full).
        Nothing here awaits: a request that need not wait costs no task and no wake-up."""
        config = self.config
        klass = config.class_of(tenant)
        band = priority if priority is not None else klass.priority
        now = self.clock()
        try:
            self.limits.take(tenant, klass, prompt_tokens, now, 1.0 / max(1, self.gateways()))
        except ApiError as err:
            self.metrics.admission_refusals.labels(str(err.code)).inc()
            raise
        ticket = Ticket(self, tenant, band)
        self._seen[tenant] = now
        queue = self._queues.get(model)
        if not config.enabled:
            self._let_through(ticket, prompt_tokens)
            return ticket
        if not queue:
            placed, _ = self._placement(tenant, candidates, routing, now)
            if placed is not None:
                ticket.avoid = placed
                self._let_through(ticket, prompt_tokens)
                return ticket
        if queue is None:
            queue = self._queues[model] = FairQueue()
        if len(queue) >= config.max_waiting or queue.waiting_bytes + size_bytes > config.max_waiting_bytes:
            ticket.release()
            self.metrics.admission_refusals.labels("queue_full").inc()
            raise _unavailable("the gateway's queue is full", "queue_full", config.deadline_of(band))
        future: asyncio.Future[frozenset[str]] = asyncio.get_running_loop().create_future()
        waiter = Waiter(Request(candidates, routing, future), tenant, band, prompt_tokens, size_bytes,
                        now + config.deadline_of(band), now)
        queue.push(waiter, klass.weight)
        self._start_loop()
        return Pending(self, ticket, queue, waiter, klass.weight)

    async def admit(
        self, model: str, candidates: list[str], routing: ModelRouting, tenant: str | None, priority: int | None,
        prompt_tokens: int, size_bytes: int,
    ) -> Ticket:
        """:meth:`enter`, waiting in the queue when it must."""
        entered = self.enter(model, candidates, routing, tenant, priority, prompt_tokens, size_bytes)
        return entered if isinstance(entered, Ticket) else await entered.wait()

    def _let_through(self, ticket: Ticket, prompt_tokens: int) -> None:
        ticket.tokens = max(prompt_tokens, 1)
        self._in_flight[ticket.tenant] = self._in_flight.get(ticket.tenant, 0) + ticket.tokens
        label = ticket.tenant if ticket.tenant is not None else NO_TENANT
        self.metrics.admission_tokens.labels(label).inc(prompt_tokens)

    def finished(self, ticket: Ticket) -> None:
        self.limits.release(ticket.tenant)
        if ticket.tokens:
            left = self._in_flight.get(ticket.tenant, 0) - ticket.tokens
            if left > 0:
                self._in_flight[ticket.tenant] = left
            else:
                self._in_flight.pop(ticket.tenant, None)
        if self._queues:
            self._wakeup.set()

    def _placement(
        self, tenant: str | None, candidates: list[str], routing: ModelRouting, now: float,
    ) -> tuple[frozenset[str] | None, bool]:
        """Whether ``tenant``'s request may start now (None: not yet) and, if so, the replicas it must leave free:
        the soonest-free ones, as many as the headroom it owes the other tenants. Second, whether any candidate could
        start a request now, for the release loop, which gives headroom left free to another tenant: the
        candidates' start delays are computed once for both, as the loop does for the head of every queue on every
        poll while the fleet is saturated."""
        need = self._need(tenant, len(candidates), now)
        if need == 1:
            can_start = self.saturation.can_start(candidates, routing, self.config)
            return (frozenset() if can_start else None), can_start
        startable = self.saturation.startable(candidates, routing, self.config)
        placed = frozenset(startable[: need - 1]) if len(startable) >= need else None
        return placed, bool(startable)

    def _need(self, tenant: str | None, candidates: int, now: float) -> int:
        """How many replicas must be able to start before ``tenant``'s request may take one: 1, plus the
        ``headroom`` kept for the other active tenants when this one already holds at least its weighted share of
        what is in flight."""
        headroom = int(candidates * self.config.headroom)
        if headroom == 0:
            return 1
        active = [t for t, at in self._seen.items() if now - at <= ACTIVE_S or t in self._in_flight]
        if len(active) < 2:
            return 1
        total = sum(self._in_flight.values())
        if total == 0:
            return 1
        config = self.config
        weights = {t: config.class_of(t).weight for t in active}
        share = weights.get(tenant, config.class_of(tenant).weight) / sum(weights.values())
        return 1 + headroom if self._in_flight.get(tenant, 0) / total >= share else 1

    def explain(self, model: str, candidates: list[str], routing: ModelRouting, band: int) -> dict[str, object]:
        """Saturation as the gate sees it now, and how many requests a new one in ``band`` would wait behind."""
        capacity = self.saturation.capacity(candidates, routing, self.config)
        queue = self._queues.get(model)
        return {
            "enabled": self.config.enabled,
            "saturated": capacity.saturated(self.config),
            "start_delay_ms": None if math.isinf(capacity.start_delay_ms) else round(capacity.start_delay_ms, 2),
            "band": band,
            "waiting_ahead": queue.ahead_of(band) if queue else 0,
        }

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()

    def _start_loop(self) -> None:
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._release_loop())

    async def _release_loop(self) -> None:
        while self._queues:
            self._wakeup.clear()
            now = self.clock()
            for model, queue in list(self._queues.items()):
                for waiter in queue.expired(now):
                    queue.remove(waiter)
                    self.metrics.admission_refusals.labels("deadline").inc()
                    waiter.item.future.set_exception(_unavailable(
                        "no replica could take the request before its deadline", "queue_deadline",
                        self.config.deadline_of(waiter.band)))
                while (released := self._next(queue, now)) is not None:
                    head, avoid = released
                    request = head.item
                    if request.future.done():  # cancelled meanwhile: its own task takes it out
                        queue.remove(head)
                        continue
                    queue.pop(head)
                    request.future.set_result(avoid)
                    await asyncio.sleep(0)  # it routes and dispatches now: the next check sees its load
                    now = self.clock()
                if not queue and self._queues.get(model) is queue:
                    del self._queues[model]
            if not self._queues:
                break
            if not self._wakeup.is_set():
                # the poll sets the event as a request's end would: no task or exception per wait
                poll = asyncio.get_running_loop().call_later(POLL_S, self._wakeup.set)
                try:
                    await self._wakeup.wait()
                finally:
                    poll.cancel()

    def _next(self, queue: FairQueue[Request], now: float) -> tuple[Waiter[Request], frozenset[str]] | None:
        """The waiter to release now and the replicas it must leave free, or None: the queue's next when a replica
        can start it; when only the headroom kept for other tenants is free, the next of a tenant that may use it,
        in the same band."""
        head = queue.peek()
        if head is None:
            return None
        request, config = head.item, self.config
        if not config.enabled:
            return head, frozenset()
        placed, any_can_start = self._placement(head.tenant, request.candidates, request.routing, now)
        if placed is not None:
            return head, placed
        if not any_can_start:
            return None
        count = len(request.candidates)
        other = queue.first(head.band, lambda tenant: self._need(tenant, count, now) == 1)
        return None if other is None else (other, frozenset())

    def depth(self) -> Iterator[tuple[tuple[int, str | None], int]]:
        totals: dict[tuple[int, str | None], int] = {}
        for queue in self._queues.values():
            for key, count in queue.depth().items():
                totals[key] = totals.get(key, 0) + count
        return iter(totals.items())

    def depth_by_model(self) -> dict[str, int]:
        """Waiting requests per model (each has its queue)."""
        return {model: len(queue) for model, queue in self._queues.items() if len(queue)}

    def fairness(self) -> float:
        return self._fairness.index(self.clock())


def _unavailable(message: str, code: str, deadline_s: float) -> ApiError:
    retry_after = str(max(1, math.ceil(min(deadline_s, 30.0))))
    return ApiError(503, message, code=code, headers={"retry-after": retry_after})


class _AdmissionCollector(Collector):
    """The gate's gauges, read at scrape time: requests waiting by band and tenant, and Jain's fairness index."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate

    def collect(self) -> Iterable[Metric]:
        waiting = GaugeMetricFamily("kvgate_admission_waiting", "Requests waiting at the gateway, by priority band "
                                    "and tenant.", labels=["band", "tenant"])
        for (band, tenant), count in self.gate.depth():
            waiting.add_metric([str(band), tenant if tenant is not None else NO_TENANT], float(count))
        yield waiting
        yield GaugeMetricFamily("kvgate_admission_fairness", "Jain's fairness index over the tenants' weighted "
                                "shares of the tokens released from the queue lately (1: equal shares).",
                                value=self.gate.fairness())
