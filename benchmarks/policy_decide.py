"""Per-request cost of each routing policy's decision (it runs on the request path), by fleet size.

Usage: .venv/bin/python benchmarks/policy_decide.py
Fleets mix warm, partly warm and cold replicas with live load; "cost+nixl" adds the transfer candidates.
All policies are timed side by side in one run (the machine is shared; compare ratios, not absolutes).
"""

from __future__ import annotations

import random
import time

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import Policy, ReplicaView, RouteRequest
from kvgate.policies.calibration import Calibrator
from kvgate.policies.config import CalibrationConfig, TransferConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.registry import POLICY_NAMES, create_policy
from kvgate.router.settings.schema import KvgateConfig

REQUEST = RouteRequest(request_id="bench", model="m", prompt_tokens=12_000, block_size=16)


def fleet(size: int, rng: random.Random) -> list[ReplicaView]:
    views = []
    for i in range(size):
        prefilling = rng.randint(0, 4)
        engine_up, draining = rng.random() > 0.05, rng.random() < 0.05
        views.append(
            ReplicaView(
                name=f"r{i}",
                healthy=engine_up and not draining,
                can_source=engine_up,
                draining=draining,
                match=PrefixMatch(gpu=rng.choice([0, 0, 4000, 11_000]), cpu=rng.choice([0, 2000])),
                in_flight=prefilling + rng.randint(0, 30),
                in_flight_prefilling=prefilling,
                in_flight_prefill_tokens=prefilling * rng.randint(100, 4000),
                scraped_waiting=rng.randint(0, 6),
                scraped_running=rng.randint(0, 40),
            )
        )
    return views


def per_call_us(policy: Policy, views: list[ReplicaView], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        policy.decide(REQUEST, views)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    config = KvgateConfig()
    model = config.model_or_first(None)
    base = CostModel.from_config(model.prefill, model.kv_bytes_per_token, config.policy, config.transfer)
    nixl = CostModel(base.prefill, base.tier_load_ms_per_token, TransferConfig(connector="nixl"), base.kv_bytes_per_token)
    rng = random.Random(0)
    print(f"{'replicas':>8} " + " ".join(f"{name:>16}" for name in (*POLICY_NAMES, "cost+nixl")) + "   (us per decision)")
    for size in (4, 16, 64):
        views = fleet(size, rng)
        policies = [create_policy(name, config.policy, base, random.Random(1)) for name in POLICY_NAMES]
        policies.append(create_policy("cost", config.policy, nixl, random.Random(1)))
        times = [per_call_us(p, views, 20_000 // size) for p in policies]
        print(f"{size:>8} " + " ".join(f"{t:>16.1f}" for t in times))

    calibrator = Calibrator(CalibrationConfig(), base.prefill)
    for _ in range(512):
        prompt = rng.randint(100, 16_000)
        calibrator.observe(prompt, 0, 20 + 0.04 * prompt + rng.expovariate(1 / 30), 0.0)
    start = time.perf_counter()
    calibrator.current()
    print(f"calibration refit over a full 512-sample window: {(time.perf_counter() - start) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
