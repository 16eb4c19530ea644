"""How long each request's prefill held up the other requests on its replica, read from the engine's own timeline:
the outcome the cost policy's interference term predicts (the delay a prefill imposes on the replica's next
arrivals), so the prediction audit can hold the term to it.

At every instant of a replica's engine clock, the requests then waiting in its queue are held up by the prefills then
running, and that waiting is shared equally among them: a prefill's imposed delay is its share, summed from its
admission to its first token. Waiting while no prefill runs (for KV blocks to free, behind decode steps alone) is
charged to no prefill. Summed over a replica's requests, the imposed delays are the part of its queueing that
prefills caused, each counted once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timeline:
    """One request on one replica's engine clock (ms): when it arrived, was admitted and gave its first token."""

    arrival_ms: float
    scheduled_ms: float | None
    first_token_ms: float | None


def imposed_waits(timelines: Mapping[str, Timeline]) -> dict[str, float]:
    """Per request of one replica that ran a prefill (admitted, first token given): the waiting it imposed on the
    replica's other requests, in ms of their waiting (see the module's docstring)."""
    changes: list[tuple[float, int, int, str]] = []
    """(time, change in the requests waiting, a prefill starting (1) or ending (-1) or neither (0), its request)"""
    for name, t in timelines.items():
        if t.scheduled_ms is None:
            continue
        if t.scheduled_ms > t.arrival_ms:
            changes += [(t.arrival_ms, 1, 0, name), (t.scheduled_ms, -1, 0, name)]
        if t.first_token_ms is not None and t.first_token_ms > t.scheduled_ms:
            changes += [(t.scheduled_ms, 0, 1, name), (t.first_token_ms, 0, -1, name)]
    changes.sort(key=lambda c: c[0])
    imposed = {name: 0.0 for name, t in timelines.items() if t.scheduled_ms is not None and t.first_token_ms is not None}
    running: set[str] = set()
    waiting = 0
    last = changes[0][0] if changes else 0.0
    for at, wait_change, prefill_change, name in changes:
        if at > last and running and waiting:
            share = (at - last) * waiting / len(running)
            for prefill in running:
                imposed[prefill] += share
        last = at
        waiting += wait_change
        if prefill_change > 0:
            running.add(name)
        elif prefill_change < 0:
            running.discard(name)
    return imposed
