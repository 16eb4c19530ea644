"""Engine discovery: replicas found from DNS or the Kubernetes API join and leave the fleet as the cluster changes.

One source (:mod:`kvgate.router.fleet.discovery.dns` or :mod:`kvgate.router.fleet.discovery.kubernetes`, per
``discovery.kind``) publishes the whole set it sees; :class:`~kvgate.router.fleet.discovery.sync.FleetSync` applies it
through the fleet's own add, drain and remove.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from kvgate.router.fleet.config import DiscoveryConfig, ReplicaConfig
from kvgate.router.fleet.discovery.sync import FleetSync
from kvgate.router.fleet.discovery.targets import Source, Target
from kvgate.router.fleet.state import Fleet

log = logging.getLogger(__name__)


def make_source(config: DiscoveryConfig) -> Source:
    if config.kind == "dns":
        from kvgate.router.fleet.discovery.dns import DnsSource

        return DnsSource(config)
    if config.kind == "kubernetes":
        from kvgate.router.fleet.discovery.kubernetes import KubernetesSource

        return KubernetesSource(config)
    raise ValueError(f"no discovery source of kind {config.kind!r}")


class Discovery:
    """Runs the policy file's discovery source against the fleet; a reload with another ``discovery`` section
    restarts the source, and the replicas it finds again stay as they are."""

    def __init__(self, config: DiscoveryConfig, replicas: Sequence[ReplicaConfig], fleet: Fleet) -> None:
        """``replicas``: the policy file's own, which discovery leaves alone."""
        self.config = config
        self.sync = FleetSync(fleet, config.drain_timeout_s)
        self.sync.disown({r.name for r in replicas})
        self._source_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweep_task = asyncio.create_task(self.sync.run_sweeps(), name="discovery-sweep")
        self._start_source()

    async def stop(self) -> None:
        if self._restart_task is not None:
            await asyncio.gather(self._restart_task, return_exceptions=True)
        await self._stop_source()
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            await asyncio.gather(self._sweep_task, return_exceptions=True)
            self._sweep_task = None

    def reconfigure(self, config: DiscoveryConfig, replicas: Sequence[ReplicaConfig]) -> None:
        self.sync.disown({r.name for r in replicas})
        if config == self.config:
            return
        self.config = config
        self.sync.drain_timeout_s = config.drain_timeout_s
        previous = self._restart_task
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(previous), name="discovery-restart")

    async def _restart(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:  # reloads in quick succession restart in order
            await asyncio.gather(previous, return_exceptions=True)
        await self._stop_source()
        self._start_source()

    def _start_source(self) -> None:
        if self.config.kind != "none":
            self._source_task = asyncio.create_task(self._run_source(self.config), name="discovery")
        else:
            self._source_task = asyncio.create_task(self._publish(self.config, {}), name="discovery")

    async def _stop_source(self) -> None:
        task, self._source_task = self._source_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run_source(self, config: DiscoveryConfig) -> None:
        """Run the source until cancelled; one that cannot start or fails is retried after ``interval_s``."""
        while True:
            try:
                await make_source(config).run(lambda targets: self._publish(config, targets))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discovery (%s) failed; retrying in %.1fs", config.kind, config.interval_s)
            await asyncio.sleep(config.interval_s)

    async def _publish(self, config: DiscoveryConfig, targets: Mapping[str, Target]) -> None:
        if config is self.config:  # a source being replaced does not publish any more
            await self.sync.apply(targets)


__all__ = ["Discovery", "FleetSync", "Target", "make_source"]
