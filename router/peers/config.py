"""The ``peers`` section of the policy file: the other gateway replicas, which a starting gateway takes its index
from and which share their routing hints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvgate.policies.section import Section
from kvgate.router.fleet.config import ZMQ_ENDPOINT, DnsDiscoveryConfig, PortRef, http_base_url


class HintsConfig(Section):
    """Routing hints between gateway replicas: each publishes the prompts it routes (predicted entries) and credits
    its peers' as predicted, for at most ``index.predicted_ttl_s``. Encrypted and authenticated with a key derived
    from ``server.peer_token`` (else the admin token), which must be set when hints are on."""

    bind: str | None = None
    """ZMQ endpoint this gateway publishes its hints on (a PUB socket binds it), e.g. tcp://10.0.0.20:5590; no
    hints are published when unset."""
    connect: list[str] = Field(default_factory=list)
    """The peers' hint endpoints this gateway subscribes to."""
    port: PortRef | None = None
    """With ``peers.dns``: the peers' hint port (a number with A records, the port's name with SRV records); this
    gateway subscribes to every address the name lists, re-resolved every ``resolve_interval_s``."""
    resolve_interval_s: float = Field(5.0, gt=0)
    """How often ``peers.dns`` is resolved again for hint peers."""
    work_ttl_s: float = Field(1.0, ge=0)
    """A peer's report of its dispatched work (per replica: tokens and requests still prefilling, requests per
    second) is added to this gateway's own for at most this long after it was sent; 0 shares none."""

    @field_validator("connect")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        for endpoint in v:
            if not ZMQ_ENDPOINT.match(endpoint):
                raise ValueError(f"{endpoint!r}: expected tcp://host:port, ipc://path or inproc://name")
        return v

    @field_validator("bind")
    @classmethod
    def _bind(cls, v: str | None) -> str | None:
        if v is not None and not ZMQ_ENDPOINT.match(v):
            raise ValueError(f"{v!r}: expected tcp://host:port, ipc://path or inproc://name")
        return v


class PeersConfig(Section):
    """The other kvgate replicas in front of the same engines: a starting gateway takes its prefix index from one of
    them (warm start) instead of starting cold. Off when neither ``urls`` nor ``dns.name`` is set."""

    urls: list[str] = Field(default_factory=list)
    """Base URLs of the peers, e.g. http://kvgate-1.kvgate-peers:8000."""
    dns: DnsDiscoveryConfig = DnsDiscoveryConfig()
    """The gateways' own headless Service, resolved like engine discovery's (``name``, ``record``,
    ``nameservers``); every address found is a peer, this gateway's own included (it declines to answer itself)."""
    port: PortRef = 8000
    """The peers' HTTP port with ``dns``: a number with A records, the port's name with SRV records."""
    scheme: Literal["http", "https"] = "http"
    """Scheme of the peers' URLs found by DNS."""
    warm_start_timeout_s: float = Field(10.0, ge=0)
    """/ready answers 503 while the snapshot is taken, at most this long; then the gateway goes on cold."""
    max_snapshot_bytes: int = Field(512 * 1024 * 1024, gt=0)
    """A larger snapshot is refused (by the peer and by the receiver); about 25 bytes per held block."""
    hints: HintsConfig = HintsConfig()

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, v: list[str]) -> list[str]:
        return [http_base_url(url) for url in v]

    @model_validator(mode="after")
    def _ports(self) -> "PeersConfig":
        if self.dns.name and (self.dns.record == "A") != isinstance(self.port, int):
            raise ValueError("port must be a number with A records and a name with SRV records")
        hint_port = self.hints.port
        if hint_port is not None and self.dns.name and (self.dns.record == "A") != isinstance(hint_port, int):
            raise ValueError("hints.port must be a number with A records and a name with SRV records")
        if hint_port is not None and not self.dns.name:
            raise ValueError("hints.port needs peers.dns.name (the gateways' headless Service)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.dns.name)
