"""Helpers every policy shares: which replicas are eligible, and one number for how loaded a replica is."""

from __future__ import annotations

import random
from typing import Sequence

from policies.base import ReplicaView


def eligible(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The healthy replicas, or all of them when none is healthy.

    Policies choose only among these, so an unhealthy replica is never picked while a healthy one exists; when the
    whole fleet looks down, trying someone beats refusing outright (health may lag reality).
    """
    healthy = [r for r in replicas if r.healthy]
    return healthy if healthy else list(replicas)


def replica_load(view: ReplicaView) -> int:
    """Requests queued or running on a replica, as best known.

    The engine's scraped ``waiting + running`` already includes the router's own requests and also sees other
    routers' traffic, but it lags by a scrape interval; the router's ``in_flight`` is exact for its own traffic.
    Taking the larger of the two counts each request once and never misses a fresh dispatch.
    """
    if view.scraped_waiting is None and view.scraped_running is None:
        return view.in_flight
    scraped = (view.scraped_waiting or 0) + (view.scraped_running or 0)
    return max(view.in_flight, scraped)


def least_loaded(views: Sequence[ReplicaView], rng: random.Random) -> ReplicaView:
    """The least-loaded view, ties broken at random so that routers and requests do not pile onto the first one."""
    lowest = min(replica_load(v) for v in views)
    return rng.choice([v for v in views if replica_load(v) == lowest])


def rank_by_load(first: ReplicaView, views: Sequence[ReplicaView]) -> list[str]:
    """``first`` then the others by load, the order a retry should walk."""
    rest = sorted((v for v in views if v.name != first.name), key=replica_load)
    return [first.name, *(v.name for v in rest)]
