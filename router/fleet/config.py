"""The fleet's sections of the policy file: the replicas listed in it, and the ones discovered from DNS or the
Kubernetes API."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvgate.policies.section import Section

Role = Literal["prefill", "decode", "both"]
"""A replica's part in prefill/decode disaggregation."""

ZMQ_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})|ipc://\S+|inproc://\S+)$")
"""What kvgate can connect a ZMQ socket to: tcp://host:port (IPv6 in brackets), ipc://path or inproc://name."""


class ReplicaConfig(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Unique replica name (letters, digits, _ . : -); shown in x-kvgate-replica, metrics and logs."""
    url: str
    """Base URL of the engine's HTTP server, e.g. http://10.0.0.5:8000."""
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV-event publisher (e.g. tcp://10.0.0.5:5557); no prefix index for it if unset."""
    kv_replay: str | None = None
    """ZMQ endpoint of the engine's replay ROUTER socket; gaps purge instead of repair if unset."""
    kv_topic: str = ""
    """SUB topic filter (vLLM's ``topic``; empty receives all)."""
    engine: Literal["vllm", "sglang"] = "vllm"
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form labels (e.g. zone, GPU type), shown by /admin/replicas."""
    role: Role = "both"
    """prefill: only runs the prefill leg of disaggregated requests, never takes a client's request itself; decode:
    takes client requests, and its KV from a prefill replica when the policy disaggregates; both: either (see
    docs/disaggregation.md)."""
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    """An SGLang prefill server's bootstrap port (``--disaggregation-bootstrap-port``); required for an ``sglang``
    replica whose role is ``prefill``, refused for other engines."""

    @model_validator(mode="after")
    def _bootstrap(self) -> "ReplicaConfig":
        if self.bootstrap_port is not None and self.engine != "sglang":
            raise ValueError("bootstrap_port is only meaningful for engine: sglang")
        if self.engine == "sglang" and self.role == "prefill" and self.bootstrap_port is None:
            raise ValueError("an sglang replica whose role is prefill needs its bootstrap_port")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return http_base_url(v)

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        match = ZMQ_ENDPOINT.match(v)
        if match is None or (match.group(3) is not None and not 0 < int(match.group(3)) < 65536):
            raise ValueError(f"{v!r} is not a ZMQ endpoint (tcp://host:port, ipc://path or inproc://name)")
        return v


def http_base_url(url: str) -> str:
    """``url`` as the base of a replica's HTTP API (no trailing slash); ``ValueError`` unless it is an http(s) URL
    with a host, a port in range if any, and no query, fragment or credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # an unclosed IPv6 bracket, a port that is no number or out of range
        raise ValueError(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("must start with http:// or https://")
    if not parts.hostname:
        raise ValueError("has no host")
    if port == 0:
        raise ValueError("port 0 is no port to connect to")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError("must not have a query, a fragment or credentials")
    return url.rstrip("/")


PortRef = Annotated[int, Field(ge=1, le=65535)] | Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")]
"""A port number, or a port's name as Kubernetes spells them (IANA service names)."""


class DiscoveryPorts(Section):
    """An engine's ports: numbers, or names (a pod's container port names; with SRV, ``_NAME._tcp.<dns.name>``)."""

    http: PortRef = 8000
    """The engine's HTTP port (OpenAI API, /health, /metrics)."""
    kv_events: PortRef | None = 5557
    """The KV-event publisher's port; null: no prefix index for discovered replicas."""
    kv_replay: PortRef | None = 5558
    """The replay socket's port; null: gaps purge instead of repair."""
    bootstrap: PortRef | None = None
    """SGLang prefill servers' bootstrap port; discovered sglang prefill replicas without one are skipped."""


class DnsDiscoveryConfig(Section):
    name: str = ""
    """Fully qualified name of the engines' headless Service, e.g. vllm.default.svc.cluster.local."""
    record: Literal["A", "SRV"] = "A"
    """A: one replica per address, numbered ports. SRV: one per ``_<ports.http>._tcp.<name>`` record (host and HTTP
    port); named event ports from their own SRV records by host."""
    nameservers: list[str] = Field(default_factory=list)
    """Addresses of the DNS servers to ask: ``IP``, ``IP:port`` or ``[IPv6]:port``; empty: the system's
    (/etc/resolv.conf)."""
    timeout_s: float = Field(2.0, gt=0)
    """One resolution slower than this fails; the last good answer stays in force."""

    @field_validator("nameservers")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        for spec in v:
            parse_nameserver(spec)
        return v


def parse_nameserver(spec: str) -> tuple[str, int]:
    """``IP``, ``IP:port`` or ``[IPv6]:port`` → (address, port); ``ValueError`` otherwise."""
    host, port = spec, 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{spec!r}: expected [IPv6]:port")
            port = int(rest[1:])
    elif spec.count(":") == 1:
        host, port_text = spec.split(":")
        port = int(port_text)
    ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError(f"{spec!r}: port out of range")
    return host, port


class KubernetesDiscoveryConfig(Section):
    label_selector: str = ""
    """Pods matching this selector are the engines, e.g. ``app=vllm``."""
    namespace: str | None = None
    """The pods' namespace; null: the gateway's own (the service account's namespace file)."""
    api_server: str | None = None
    """API server base URL; null: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT."""
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    """Bearer token, re-read before every list and watch (it is rotated); not sent when the file is absent."""
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    """CA bundle for an https API server; the system's when the file is absent."""
    watch_timeout_s: float = Field(300.0, gt=0)
    """The API server ends each watch after this long; it is resumed from the last resourceVersion."""
    role_label: str = "kvgate.io/role"
    """Pod label (or, when no such label, annotation) whose value (prefill, decode, both) is the replica's role; pods
    without a valid one take ``discovery.role``."""


class DiscoveryConfig(Section):
    """Engine replicas found from DNS or the Kubernetes API, next to the ``replicas`` listed here."""

    kind: Literal["none", "dns", "kubernetes"] = "none"
    """Where discovered replicas come from: none, dns (a headless Service's records), kubernetes (a pod watch)."""
    interval_s: float = Field(5.0, gt=0)
    """DNS: seconds between resolutions. Kubernetes: wait before retrying a failed list or watch."""
    drain_timeout_s: float = Field(60.0, ge=0)
    """A replica that disappeared is drained, and removed once its requests are done or after this long."""
    engine: Literal["vllm", "sglang"] = "vllm"
    """The discovered engines' kind."""
    role: Role = "both"
    """The discovered replicas' role (DNS: all of them; Kubernetes: pods without a role label)."""
    model: str | None = None
    """The model they serve (their ``model`` label); null: the first of ``models``."""
    scheme: Literal["http", "https"] = "http"
    """Scheme of the discovered engines' URLs."""
    kv_topic: str = ""
    """SUB topic filter for their KV events."""
    ports: DiscoveryPorts = DiscoveryPorts()
    dns: DnsDiscoveryConfig = DnsDiscoveryConfig()
    kubernetes: KubernetesDiscoveryConfig = KubernetesDiscoveryConfig()

    @model_validator(mode="after")
    def _complete(self) -> "DiscoveryConfig":
        ports = (self.ports.http, self.ports.kv_events, self.ports.kv_replay)
        if self.kind == "dns":
            if not self.dns.name:
                raise ValueError("dns.name is required when kind is dns")
            if self.dns.record == "A" and any(isinstance(p, str) for p in ports):
                raise ValueError("ports must be numbers with A records (names need SRV records)")
            if self.dns.record == "SRV" and not isinstance(self.ports.http, str):
                raise ValueError("ports.http must be a service name with SRV records (e.g. http)")
        if (self.kind == "dns" and self.engine == "sglang" and self.role == "prefill"
                and not isinstance(self.ports.bootstrap, int)):
            raise ValueError("ports.bootstrap (a number) is required for sglang prefill replicas found by DNS")
        if self.kind == "kubernetes" and not self.kubernetes.label_selector:
            raise ValueError("kubernetes.label_selector is required when kind is kubernetes")
        return self
