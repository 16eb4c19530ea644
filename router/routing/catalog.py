"""The models the fleet serves: the policy file's ``models`` (the catalog), and which replicas serve which model.

A model is known when the policy file declares it or a healthy replica lists it in its ``/v1/models``; a LoRA adapter
is listed by vLLM as its own model, whose ``parent`` is its base model. The catalog answers the questions every
stage asks about a request's model, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.router.core.config import ModelConfig
from kvgate.router.fleet.replica import Replica
from kvgate.router.fleet.state import Fleet


class ModelCatalog:
    def __init__(self, models: Sequence[ModelConfig], fleet: Fleet) -> None:
        self.fleet = fleet
        self.reconfigure(models)

    def reconfigure(self, models: Sequence[ModelConfig]) -> None:
        self.models = list(models)
        self._by_name = {m.name: m for m in self.models}

    def config_of(self, name: str) -> ModelConfig | None:
        """The policy file's entry for ``name``, if it has one."""
        return self._by_name.get(name)

    def priced_as(self, name: str | None) -> ModelConfig:
        """The entry ``name`` is priced with (its cost constants): its own, else the first model's (a model only its
        replicas declare), else the defaults."""
        found = self._by_name.get(name) if name is not None else None
        return found or (self.models[0] if self.models else ModelConfig(name=""))

    def model_of(self, replica: Replica) -> str:
        """The model a replica serves, as its KV events are indexed: its label ``model``, else the first model's."""
        return replica.config.labels.get("model") or (self.models[0].name if self.models else "")

    def base_models(self) -> set[str]:
        """The models the fleet serves (its healthy replicas' base models, not their adapters) and the policy file
        declares."""
        served = {m["id"] for m in self.fleet.models() if isinstance(m.get("id"), str) and not m.get("parent")}
        return served | set(self._by_name)

    def knows(self, model: str) -> bool:
        """Served by a healthy replica, or declared in the policy file."""
        return model in self._by_name or any(m.get("id") == model for m in self.fleet.models())

    def candidates(self, model: str) -> list[str]:
        """Replicas that list ``model`` in their /v1/models, or every replica when none does (not probed yet, or a
        model only the policy file declares)."""
        serving = [
            r.name for r in self.fleet.replicas.values() if any(m.get("id") == model for m in r.served_models)
        ]
        return serving or list(self.fleet.replicas)

    def takes_requests(self, names: Sequence[str]) -> bool:
        """Whether one of ``names`` takes client requests (prefill replicas only run disaggregated prefill legs)."""
        replicas = self.fleet.replicas
        return any(replicas[name].config.role != "prefill" for name in names)

    def max_model_len(self, base_model: str) -> int | None:
        """The model's longest prompt: the policy file's ``max_model_len``, else the largest its replicas report."""
        configured = self._by_name.get(base_model)
        if configured is not None and configured.max_model_len is not None:
            return configured.max_model_len
        reported = [
            m["max_model_len"] for r in self.fleet.replicas.values() for m in r.served_models
            if m.get("id") == base_model and type(m.get("max_model_len")) is int and m["max_model_len"] > 0
        ]
        return max(reported, default=None)
