"""Helpers every policy shares: which replicas are eligible, and one number for how loaded a replica is."""

from __future__ import annotations

import random
from typing import Mapping, Sequence

from kvgate.policies.base import ReplicaView


def eligible(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The healthy replicas that take client requests (every role but ``prefill``), or all of those when none is
    healthy.

    Policies choose only among these, so an unhealthy replica is never picked while a healthy one exists; when the
    whole fleet looks down, trying someone beats refusing outright (health may lag reality). A prefill replica is
    never one of them: it only runs disaggregated requests' prefill legs. The router never asks a policy to decide
    without a replica that takes requests, so the result is never empty.
    """
    healthy = [r for r in replicas if r.healthy and r.role != "prefill"]
    return healthy if healthy else [r for r in replicas if r.role != "prefill"]


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


def expected_arrival_rates(views: Sequence[ReplicaView], cached_tokens: Mapping[str, int]) -> dict[str, float]:
    """Per replica, the arrival rate a prefill started there now will hold up: its own recent rate, except that a
    replica that would recompute a prefix another replica holds (it caches fewer of the prompt's tokens,
    ``cached_tokens``, than the best) counts at least the fleet's mean rate per replica.

    Such a recompute makes a new copy: the replica becomes a holder of a prefix someone is asking for, and its later
    requests go there too. Pricing the copy at the replica's past rate alone (zero, on a replica nobody has used yet)
    calls it free, and long prefixes get copied onto idle replicas whenever their holder has a momentary queue, each
    copy a full prefill. A request nobody holds (a cold one) is priced at the replica's own rate, so new work still
    goes where it holds up the fewest arrivals.
    """
    if not views:
        return {}
    mean = sum(v.arrival_rate_per_s for v in views) / len(views)
    best = max((cached_tokens.get(v.name, 0) for v in views), default=0)
    return {
        v.name: max(v.arrival_rate_per_s, mean) if cached_tokens.get(v.name, 0) < best else v.arrival_rate_per_s
        for v in views
    }


def least_loaded(views: Sequence[ReplicaView], rng: random.Random) -> ReplicaView:
    """The least-loaded view, ties broken at random so that routers and requests do not pile onto the first one."""
    lowest = min(replica_load(v) for v in views)
    return rng.choice([v for v in views if replica_load(v) == lowest])


def rank_by_load(first: ReplicaView, views: Sequence[ReplicaView]) -> list[str]:
    """``first`` then the others by load, the order a retry should walk."""
    rest = sorted((v for v in views if v.name != first.name), key=replica_load)
    return [first.name, *(v.name for v in rest)]
