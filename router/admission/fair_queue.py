"""The waiting requests of one model, in the order they are released: priority band first (lower first, vLLM's
meaning), then weighted fairness between tenants in prefill tokens, then arrival.

Fairness is weighted fair queuing within each band: a request starts where its tenant's previous request ended, or
at the band's virtual time when the tenant has nothing waiting ahead of it, and ends its prompt tokens over the
tenant's weight later; the earliest end goes first, and the band's virtual time follows the starts released. A
tenant that floods the band with long prompts pushes only its own ends ahead: another tenant's short request,
arriving after a hundred of them, ends near the virtual time and goes next.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One waiting request and what ordering it needs; ``item`` is the caller's own."""

    item: T
    tenant: str | None
    band: int
    tokens: int
    size_bytes: int
    deadline: float
    enqueued_at: float
    start: float = 0.0
    tag: float = 0.0
    seq: int = 0
    gone: bool = False
    """Released, expired or removed: its heap entry is skipped when it comes up."""


@dataclass(slots=True)
class _Band(Generic[T]):
    heap: list[tuple[float, int, Waiter[T]]] = field(default_factory=list)
    virtual_time: float = 0.0
    finish: dict[str | None, float] = field(default_factory=dict)
    """Each tenant's last tag in this band."""
    live: int = 0


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._bands: dict[int, _Band[T]] = {}
        self._seq = itertools.count()
        self.waiting = 0
        self.waiting_bytes = 0
        self._next_deadline = math.inf
        """No waiter's deadline is earlier (a waiter gone since may have had this one): :meth:`expired` looks at
        none of them before it."""

    def __len__(self) -> int:
        return self.waiting

    def push(self, waiter: Waiter[T], weight: float) -> None:
        band = self._bands.get(waiter.band)
        if band is None:
            band = self._bands[waiter.band] = _Band()
        waiter.start = max(band.virtual_time, band.finish.get(waiter.tenant, 0.0))
        waiter.tag = waiter.start + max(waiter.tokens, 1) / weight
        waiter.seq = next(self._seq)
        band.finish[waiter.tenant] = waiter.tag
        heapq.heappush(band.heap, (waiter.tag, waiter.seq, waiter))
        band.live += 1
        self.waiting += 1
        self.waiting_bytes += waiter.size_bytes
        self._next_deadline = min(self._next_deadline, waiter.deadline)

    def peek(self) -> Waiter[T] | None:
        """The next to release, or None."""
        for key in sorted(self._bands):
            band = self._bands[key]
            while band.heap and band.heap[0][2].gone:
                heapq.heappop(band.heap)
            if band.heap:
                return band.heap[0][2]
        return None

    def first(self, band: int, eligible: Callable[[str | None], bool]) -> Waiter[T] | None:
        """The next to release in ``band`` among the tenants ``eligible`` says may go now (the others held back)."""
        found = self._bands.get(band)
        if found is None:
            return None
        best: tuple[float, int, Waiter[T]] | None = None
        for entry in found.heap:
            if not entry[2].gone and (best is None or entry[:2] < best[:2]) and eligible(entry[2].tenant):
                best = entry
        return None if best is None else best[2]

    def pop(self, waiter: Waiter[T]) -> None:
        """Release ``waiter`` (the one :meth:`peek` gave): the band's virtual time moves to where it started."""
        band = self._bands[waiter.band]
        band.virtual_time = max(band.virtual_time, waiter.start)
        self._forget(waiter)

    def remove(self, waiter: Waiter[T]) -> None:
        """Take out a waiter that leaves without being released (expired, or its client left)."""
        if not waiter.gone:
            self._forget(waiter)

    def _forget(self, waiter: Waiter[T]) -> None:
        waiter.gone = True
        band = self._bands[waiter.band]
        band.live -= 1
        self.waiting -= 1
        self.waiting_bytes -= waiter.size_bytes
        if band.live == 0:  # an empty band forgets its tenants' tags; its virtual time stays
            band.heap.clear()
            band.finish.clear()

    def expired(self, now: float) -> list[Waiter[T]]:
        """Waiters whose deadline passed (still queued). The release loop asks every few milliseconds: the waiters
        are looked at only once the earliest deadline has come."""
        if now < self._next_deadline:
            return []
        live = [w for band in self._bands.values() for _, _, w in band.heap if not w.gone]
        self._next_deadline = min((w.deadline for w in live if w.deadline > now), default=math.inf)
        return [w for w in live if w.deadline <= now]

    def depth(self) -> dict[tuple[int, str | None], int]:
        """Waiting requests by (band, tenant)."""
        counts: dict[tuple[int, str | None], int] = {}
        for key, band in self._bands.items():
            for _, _, w in band.heap:
                if not w.gone:
                    counts[(key, w.tenant)] = counts.get((key, w.tenant), 0) + 1
        return counts

    def ahead_of(self, band: int) -> int:
        """Requests that would be released before a new one in ``band`` (every one in its band and those above)."""
        return sum(b.live for key, b in self._bands.items() if key <= band)
