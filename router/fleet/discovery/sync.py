"""Applies a discovery source's replica sets to the fleet, through the same ``add``/``drain``/``remove`` the admin API
uses, so discovered replicas get the same probes, KV-event subscriptions and index entries as configured ones.

A replica that disappears is drained at once (no new requests) and removed when its last request finished, or after
``drain_timeout_s``; one that reappears while draining is taken back. A replica that is not ready is drained and
undrained when it is ready again. A name that now stands for another engine (new address, pod, or restart) is
replaced: what the index knew about the old engine is not the new one's cache. Names the policy file or the admin API
own are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from kvgate.router.fleet.discovery.targets import Target
from kvgate.router.fleet.state import Fleet

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.1
"""How often draining replicas are checked for their last request finishing."""


class FleetSync:
    def __init__(self, fleet: Fleet, drain_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.owned: dict[str, Target] = {}
        """Replicas discovery added and still has in the fleet, as last seen."""
        self.drained: set[str] = set()
        """Owned replicas discovery drained (not ready, or leaving); it undrains only these."""
        self.leaving: dict[str, float] = {}
        """Owned replicas no longer discovered, with the time they are removed at the latest."""
        self._conflicts: set[str] = set()
        self._lock = asyncio.Lock()
        """Applying a set and sweeping both add and remove replicas: one at a time."""

    async def apply(self, targets: Mapping[str, Target]) -> None:
        """Make the fleet's discovered replicas what ``targets`` says."""
        async with self._lock:
            await self._apply(targets)

    async def _apply(self, targets: Mapping[str, Target]) -> None:
        for name in list(self.owned):
            if name not in self.fleet.replicas:  # removed through the admin API: added again below if still seen
                self._forget(name)
        for name, target in targets.items():
            await self._apply_one(name, target)
        for name in self.owned.keys() - targets.keys() - self.leaving.keys():
            log.info("discovery: replica %s is gone: draining", name)
            self._drain(name)
            self.leaving[name] = self.clock() + self.drain_timeout_s

    def disown(self, names: set[str]) -> None:
        """The policy file now lists these names: they are its replicas, not discovery's."""
        for name in names & self.owned.keys():
            self._forget(name)

    async def sweep(self) -> None:
        """Remove leaving replicas whose requests are all done or whose drain timed out."""
        async with self._lock:
            await self._sweep()

    async def _sweep(self) -> None:
        now = self.clock()
        for name, deadline in list(self.leaving.items()):
            replica = self.fleet.replicas.get(name)
            if replica is None:
                self._forget(name)
            elif replica.in_flight == 0 or now >= deadline:
                log.info("discovery: removing replica %s (%d requests in flight)", name, replica.in_flight)
                self._forget(name)
                await self.fleet.remove(name)

    async def run_sweeps(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self.sweep()
            except Exception:  # a bug in one sweep must not leave drained replicas for good
                log.exception("discovery: sweep failed")

    async def _apply_one(self, name: str, target: Target) -> None:
        current = self.owned.get(name)
        if current is None:
            if name in self.fleet.replicas:
                if name not in self._conflicts:
                    log.warning("discovery: replica %s is configured already; the configured one is kept", name)
                    self._conflicts.add(name)
                return
            self._add(name, target)
            return
        if (current.config, current.instance) != (target.config, target.instance):
            log.info("discovery: replica %s is another engine now: replacing it", name)
            self._forget(name)
            await self.fleet.remove(name)
            self._add(name, target)
            return
        self.owned[name] = target
        if self.leaving.pop(name, None) is not None:
            log.info("discovery: replica %s is back", name)
        if target.ready and name in self.drained:
            log.info("discovery: replica %s is ready: taking requests", name)
            self._undrain(name)
        elif not target.ready and name not in self.drained:
            log.info("discovery: replica %s is not ready: draining", name)
            self._drain(name)

    def _add(self, name: str, target: Target) -> None:
        log.info("discovery: adding replica %s at %s%s", name, target.config.url,
                 "" if target.ready else " (not ready)")
        self.fleet.add(target.config)
        self.owned[name] = target
        if not target.ready:
            self._drain(name)

    def _drain(self, name: str) -> None:
        if name not in self.drained:
            self.fleet.drain(name)
            self.drained.add(name)

    def _undrain(self, name: str) -> None:
        if name in self.drained:
            self.fleet.undrain(name)
            self.drained.discard(name)

    def _forget(self, name: str) -> None:
        self.owned.pop(name, None)
        self.drained.discard(name)
        self.leaving.pop(name, None)
