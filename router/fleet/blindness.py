"""Whether this gateway is blind to other callers of its engines: other gateways without ``peers`` configured, or
clients calling the engines directly.

Each engine's finished-requests counter (scraped) counts every caller's requests; this gateway knows its own (the
requests it sent that are over) and what its peers report dispatching. In a steady state the engine's finish rate
equals the sum of those. When it is persistently higher, the gateway routes on a partial view: it predicts queues
too short, places siblings cold that another gateway just warmed, and cannot know. Three gateways behind one load
balancer with no ``peers`` each see about two thirds of the engines' load as unseen.

Own completions, not dispatches, are compared with the engine's finishes: a request in flight has been dispatched
and not finished, so dispatches run ahead of finishes by what is in flight, while completions trail arrivals as the
engine's finishes do. Both are counted at the same scrapes (:meth:`Replica.record_scrape`) into rates of the same
half-life. The share is judged only while this gateway itself sends ``MIN_OWN_PER_S`` or more and the engines finish
``MIN_ENGINE_PER_S``, so a quiet fleet or the tail of a burst decides nothing; it must hold at or above
``UNSEEN_SHARE_ON`` for ``SUSTAIN_S`` to raise the signal, and below ``UNSEEN_SHARE_OFF`` (or without evidence) as
long to clear it, so it does not flap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

UNSEEN_SHARE_ON = 0.25
"""Share of the engines' finishes this gateway cannot account for that makes it blind (a third gateway's share is
0.67, a client calling one engine of eight directly at the gateway's rate per engine about 0.11 fleet-wide)."""
UNSEEN_SHARE_OFF = 0.10
"""Below this share, sustained, the signal clears."""
SUSTAIN_S = 10.0
"""How long the share must hold above (or below) its threshold: longer than a scrape's or a burst's noise."""
MIN_ENGINE_PER_S = 2.0
"""The engines' summed finish rate below which nothing is judged: too few requests to tell a share from noise."""
MIN_OWN_PER_S = 1.0
"""This gateway's own dispatch rate below which nothing is judged: an idle gateway sees every finish as unseen, and
routes nothing on its partial view."""
MAX_NAMED_REPLICAS = 16
"""Replicas a warning or the admin API names; the rest are counted."""


@dataclass(frozen=True, slots=True)
class Observation:
    """Rates summed over the fleet at one instant (requests per second)."""

    engine_per_s: float
    """What the engines finished, every caller's."""
    seen_per_s: float
    """What this gateway completed plus what its peers report dispatching."""
    own_dispatch_per_s: float

    @property
    def unseen_share(self) -> float | None:
        """The share of the engines' finishes nobody known sent; None without enough evidence."""
        if self.engine_per_s < MIN_ENGINE_PER_S or self.own_dispatch_per_s < MIN_OWN_PER_S:
            return None
        return max(0.0, self.engine_per_s - self.seen_per_s) / self.engine_per_s


class Blindness:
    """The signal with its hysteresis: fed an :class:`Observation` now and then, it says whether the gateway is blind
    and since when, and logs once when an episode starts and once when it ends."""

    def __init__(self) -> None:
        self.blind = False
        self.since: float | None = None
        """When the current state (blind or not) was entered; None before the first judgement."""
        self.share: float | None = None
        """The last unseen share judged (None: no evidence)."""
        self._crossing_since: float | None = None
        """When the share began to sit on the other side of the threshold that would flip the state."""
        self.replicas: list[str] = []
        """The replicas whose own unseen share was at or above ``UNSEEN_SHARE_ON`` at the last judgement."""

    def update(self, now: float, seen: Observation, replicas: Iterable[str] = ()) -> None:
        """Judge ``seen``; ``replicas`` are those whose own share is at or above ``UNSEEN_SHARE_ON``, for the warning
        and the admin API."""
        share = seen.unseen_share
        self.share = share
        self.replicas = sorted(replicas)
        if self.blind:
            crossing = share is None or share < UNSEEN_SHARE_OFF
        else:
            crossing = share is not None and share >= UNSEEN_SHARE_ON
        if not crossing:
            self._crossing_since = None
            return
        if self._crossing_since is None:
            self._crossing_since = now
        if now - self._crossing_since < SUSTAIN_S:
            return
        self.blind = not self.blind
        self.since = now
        self._crossing_since = None
        if self.blind:
            log.warning(
                "%.0f%% of the requests the engines finished were sent by nobody this gateway knows (%.1f/s finished, "
                "%.1f/s sent by this gateway and its peers; replicas %s): other gateways without peers configured, or "
                "clients calling the engines directly, and routing sees only part of the engines' load; configure "
                "peers (peers.hints, docs/deploying.md, 'Several gateway replicas') so the gateways share what they "
                "send", 100.0 * (share or 0.0), seen.engine_per_s, seen.seen_per_s, named(self.replicas))
        else:
            log.info("the engines' load is accounted for again: this gateway and its known peers sent what they "
                     "finish (unseen share %s)", "unknown" if share is None else f"{100.0 * share:.0f}%")

    def state(self, now: float) -> dict[str, object]:
        """For the admin API: blind or not, the share last judged, for how long the state has held, and the replicas
        with an unseen share of their own (at most ``MAX_NAMED_REPLICAS``; ``replicas_total`` counts them)."""
        return {"blind": self.blind, "unseen_share": None if self.share is None else round(self.share, 3),
                "for_s": None if self.since is None else round(now - self.since, 1),
                "replicas": self.replicas[:MAX_NAMED_REPLICAS], "replicas_total": len(self.replicas)}


def named(replicas: list[str]) -> str:
    """A log line's list of replicas, at most ``MAX_NAMED_REPLICAS`` of them."""
    if not replicas:
        return "-"
    more = len(replicas) - MAX_NAMED_REPLICAS
    return ", ".join(replicas[:MAX_NAMED_REPLICAS]) + (f" and {more} more" if more > 0 else "")


class BlindnessCollector(Collector):
    """``kvgate_blind`` and ``kvgate_unseen_request_rate`` per replica, read at scrape time."""

    def __init__(self, blindness: Blindness, unseen: Callable[[], Iterable[tuple[str, float]]]) -> None:
        self.blindness = blindness
        self.unseen = unseen

    def collect(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily("kvgate_unseen_request_rate", "Requests per second a replica's engine finished "
                                 "beyond what this gateway completed there and its peers report sending.",
                                 labels=["replica"])
        for name, per_s in self.unseen():
            rate.add_metric([name], per_s)
        yield rate
        yield GaugeMetricFamily("kvgate_blind", "1 while the engines finish persistently more requests than this "
                                "gateway and its known peers sent (configure peers).",
                                value=1.0 if self.blindness.blind else 0.0)
