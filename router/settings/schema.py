"""The policy file: one YAML document, validated into a typed config.

The root of the schema: each section is defined next to the component that reads it (those several floors of the
gateway read in :mod:`kvgate.router.core.config`, the upstream client's in :mod:`kvgate.router.upstream.config`, the
fleet's in :mod:`kvgate.router.fleet.config`, routing's in :mod:`kvgate.router.routing.config`, admission's in
:mod:`kvgate.router.admission.config`, the peers' in :mod:`kvgate.router.peers.config`, tracing's in
:mod:`kvgate.router.pipeline.tracing`, the policies' and the cost model's in :mod:`kvgate.policies.config`) and
assembled here. Every field has a default and a docstring; docs/configuration.md lists them. A bad file is rejected
with the dotted path of the offending field (pydantic's ``loc``) and the problem. Unknown keys are errors, so a typo
never silently does nothing.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from kvgate.policies.config import (
    CalibrationConfig, DisaggregationConfig, PolicyConfig, ReplicationConfig, TransferConfig,
)
from kvgate.policies.section import Section
from kvgate.router.admission.config import AdmissionConfig
from kvgate.router.core.config import IndexConfig, LimitsConfig, ModelConfig, ServerConfig, TenantsConfig
from kvgate.router.core.errors import ConfigError
from kvgate.router.fleet.config import DiscoveryConfig, ReplicaConfig
from kvgate.router.peers.config import PeersConfig
from kvgate.router.pipeline.tracing import TracingConfig
from kvgate.router.routing.config import ParityConfig, ResponsesConfig
from kvgate.router.upstream.config import BreakerConfig, HealthConfig, ProxyConfig, ScrapeConfig


class KvgateConfig(Section):
    """The whole policy file."""

    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    """The engine replicas (more can be added at runtime through /admin/replicas)."""
    models: list[ModelConfig] = Field(default_factory=list)
    """Per-model tokenizer, block size, weight version and cost constants."""
    health: HealthConfig = HealthConfig()
    breaker: BreakerConfig = BreakerConfig()
    proxy: ProxyConfig = ProxyConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    index: IndexConfig = IndexConfig()
    tenants: TenantsConfig = TenantsConfig()
    policy: PolicyConfig = PolicyConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    transfer: TransferConfig = TransferConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    replication: ReplicationConfig = ReplicationConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    peers: PeersConfig = PeersConfig()
    parity: ParityConfig = ParityConfig()
    responses: ResponsesConfig = ResponsesConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tracing: TracingConfig = TracingConfig()

    @model_validator(mode="after")
    def _unique_names(self) -> "KvgateConfig":
        names = [r.name for r in self.replicas]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"replicas: duplicate name(s) {sorted(dup)}")
        if self.replicas and self.discovery.kind == "none" and all(r.role == "prefill" for r in self.replicas):
            raise ValueError("replicas: every replica is a prefill replica, so none can take a client's request")
        models = [m.name for m in self.models]
        if len(set(models)) != len(models):
            raise ValueError("models: duplicate model name")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def model_or_first(self, name: str | None) -> ModelConfig:
        """The model whose cost constants ``name`` is priced with: its own entry, else the first model's (a model
        only its replicas declare), else the defaults."""
        return (self.model(name) if name is not None else None) or next(iter(self.models), ModelConfig(name=""))


SECRET_KEYED_FIELDS = frozenset({"api_keys"})
"""Mappings whose keys are secrets (``tenants.api_keys``: API key → tenant): an error names the entry, never the key."""


def format_validation_error(err: ValidationError) -> str:
    """The fields at fault and what is wrong, never a value: pydantic's message (which does not quote the input) and
    its ``loc`` with the keys of :data:`SECRET_KEYED_FIELDS` masked."""
    parts = []
    for e in err.errors():
        path: list[str] = []
        for i, p in enumerate(e["loc"]):
            path.append("<key>" if i and str(e["loc"][i - 1]) in SECRET_KEYED_FIELDS else str(p))
        parts.append(f"{'.'.join(path) or '<root>'}: {e['msg']}")
    return "; ".join(parts)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where and what, without the source line PyYAML quotes (it may hold a token or the salt secret)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or type(err).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_config(text: str, source: str = "<policy file>") -> KvgateConfig:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    try:
        return KvgateConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {format_validation_error(e)}") from e


def load_config(path: str | Path) -> KvgateConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from e
    return parse_config(text, str(p))
