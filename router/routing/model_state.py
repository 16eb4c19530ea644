"""Routing's state per base model: its cost model, policy, calibrator and hot-prefix tracker.

Built on a model's first request after each (re)load, from the model's catalog entry and the policy file's
``policy``, ``calibration``, ``transfer``, ``disaggregation`` and ``replication`` sections: a reload restarts every
model's state (calibration from the file's values). The calibrators' fits are swapped into the cost models on a
timer (:meth:`ModelStates.run_calibration`), never per request: a refit costs milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

from kvgate.policies.base import CacheMargin, Policy
from kvgate.policies.calibration import Calibrator
from kvgate.policies.config import (
    CalibrationConfig, DisaggregationConfig, PolicyConfig, ReplicationConfig, TransferConfig,
)
from kvgate.policies.cost_model import CostModel
from kvgate.policies.registry import create_policy
from kvgate.policies.replication import HotPrefixTracker
from kvgate.router.core.config import ModelConfig
from kvgate.router.routing.catalog import ModelCatalog

CALIBRATION_REFRESH_S = 1.0
"""How often calibrated prefill coefficients are refitted and swapped in."""


@dataclass(slots=True)
class ModelRouting:
    """What routing needs per base model: its settings, cost model, policy and calibrator."""

    config: ModelConfig
    cost_model: CostModel
    policy: Policy
    calibrator: Calibrator | None
    hot: HotPrefixTracker
    margins: dict[str, CacheMargin] = dataclasses.field(default_factory=dict)
    """Per replica, its cache's value at the margin, refreshed with the replication plan (every
    ``REPLICATION_INTERVAL_S``): the tracker's rates and recency against the index's holdings."""


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The sections of the policy file routing's per-model state is built from."""

    policy: PolicyConfig
    calibration: CalibrationConfig
    transfer: TransferConfig
    disaggregation: DisaggregationConfig
    replication: ReplicationConfig


class ModelStates:
    def __init__(self, catalog: ModelCatalog, settings: RoutingSettings, rng: random.Random) -> None:
        self.catalog = catalog
        self.rng = rng
        self.reconfigure(settings)

    def reconfigure(self, settings: RoutingSettings) -> None:
        """A new policy file: fresh policies, cost models and hot-prefix trackers per model (calibration restarts
        from the file's values)."""
        self.settings = settings
        self._models: dict[str, ModelRouting] = {}

    def of(self, base_model: str) -> ModelRouting:
        routing = self._models.get(base_model)
        if routing is None:
            s = self.settings
            cfg = self.catalog.config_of(base_model) or ModelConfig(name=base_model)
            priced = self.catalog.priced_as(base_model)
            cost_model = CostModel.from_config(priced.prefill, priced.kv_bytes_per_token, s.policy, s.transfer)
            policy = create_policy(s.policy.name, s.policy, cost_model, self.rng, s.disaggregation)
            calibrator = Calibrator(s.calibration, cfg.prefill) if s.calibration.enabled else None
            routing = self._models[base_model] = ModelRouting(cfg, cost_model, policy, calibrator,
                                                              HotPrefixTracker(s.replication))
        return routing

    def all(self) -> list[ModelRouting]:
        """The per-model state built so far (models that have seen a request since the last reload)."""
        return list(self._models.values())

    def coefficients(self) -> dict[str, dict[str, float]]:
        """Cost-model coefficients in force per model (calibrated or the policy file's), for metrics."""
        prefills = {model: routing.cost_model.prefill for model, routing in self._models.items()}
        return {
            "fixed_ms": {model: p.fixed_ms for model, p in prefills.items()},
            "per_token_ms": {model: p.per_token_ms for model, p in prefills.items()},
            "quadratic_ms": {model: p.quadratic_ms for model, p in prefills.items()},
            "queue_scale": {model: p.queue_scale for model, p in prefills.items()},
        }

    def refresh_calibration(self) -> None:
        """Swap in the calibrators' current fits."""
        for routing in self._models.values():
            if routing.calibrator is not None:
                routing.cost_model.prefill = routing.calibrator.current()

    async def run_calibration(self) -> None:
        """Until cancelled: refresh the calibration every ``CALIBRATION_REFRESH_S``."""
        while True:
            await asyncio.sleep(CALIBRATION_REFRESH_S)
            self.refresh_calibration()
