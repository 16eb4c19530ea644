"""What a discovery source reports: the engine replicas it sees now, each as the replica config the fleet uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.router.fleet.config import DiscoveryConfig, ReplicaConfig, Role


@dataclass(frozen=True, slots=True)
class Target:
    """One discovered engine replica."""

    config: ReplicaConfig
    ready: bool = True
    """Takes new requests (a Kubernetes pod's Ready condition; DNS lists only ready endpoints)."""
    instance: str = ""
    """Which engine process is behind the name (pod uid and restart count). When it changes, what the index knew about
    the old one is another engine's cache: the replica is replaced, not updated."""


Publish = Callable[[Mapping[str, Target]], Awaitable[None]]
"""Hands the whole current set of replicas, by name, to the fleet sync."""


class Source(Protocol):
    async def run(self, publish: Publish) -> None:
        """Find replicas until cancelled; call ``publish`` with the complete set whenever it is known. A set that is
        in doubt (the DNS server did not answer, the API server is unreachable) is not published: the last one stays."""


def replica_config(discovery: DiscoveryConfig, name: str, host: str, http: int, kv_events: int | None,
                   kv_replay: int | None, role: Role | None = None, bootstrap: int | None = None) -> ReplicaConfig:
    """The replica config of an engine found at ``host`` (an address or a host name) with these ports, in ``role``
    (the discovery section's by default). A bootstrap port is kept only for an sglang prefill replica."""
    netloc = f"[{host}]" if ":" in host else host
    labels = {"model": discovery.model} if discovery.model else {}
    return ReplicaConfig(
        name=name,
        url=f"{discovery.scheme}://{netloc}:{http}",
        kv_events=None if kv_events is None else f"tcp://{netloc}:{kv_events}",
        kv_replay=None if kv_replay is None else f"tcp://{netloc}:{kv_replay}",
        kv_topic=discovery.kv_topic,
        engine=discovery.engine,
        labels=labels,
        role=role or discovery.role,
        bootstrap_port=bootstrap if discovery.engine == "sglang" and (role or discovery.role) == "prefill" else None,
    )
