"""The simulated replica's /metrics page: the values of the moment in prometheus_client's own rendering, byte for
byte, however the engine's state moves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.loadgen.sim.engine import EngineStats
from kvgate.loadgen.sim.metrics import MetricsPage, ReplicaCollector
from kvgate.loadgen.sim.params import SimParams


class Pool:
    def __init__(self) -> None:
        self.used = 0.0

    def usage(self) -> float:
        return self.used


def fake_replica() -> SimpleNamespace:
    """What the page reads of a replica: its params, start time and engine (queues, pool, counters)."""
    engine = SimpleNamespace(running=[], waiting=[], pool=Pool(), stats=EngineStats())
    params = SimParams(model="org/model-7b", block_size=16, kv_blocks=4096, cpu_blocks=0)
    return SimpleNamespace(params=params, started_at=1_796_660_587.123456, engine=engine)


def library_page(replica: SimpleNamespace) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(replica))  # type: ignore[arg-type]
    return generate_latest(registry)


STATES = [
    {},
    {"running": 3, "waiting": 17, "usage": 0.123456789012345, "prompt_tokens": 12_345, "prefix_cache_hits": 7},
    {"running": 256, "waiting": 0, "usage": 1.0, "prompt_tokens": 10**21, "generation_tokens": 2**53 + 1,
     "requests_completed": 99, "started_at": 1_796_660_999.5},
    {"usage": 1e-7, "prefix_cache_queries": 10**7, "external_prefix_cache_hits": 5, "prompt_tokens_cached": 1},
]


@pytest.mark.parametrize("state", STATES)
def test_the_page_is_prometheus_clients_rendering_of_the_moment(state: dict[str, float]) -> None:
    replica = fake_replica()
    page = MetricsPage(replica)  # type: ignore[arg-type]
    engine = replica.engine
    engine.running = [object()] * int(state.get("running", 0))
    engine.waiting = [object()] * int(state.get("waiting", 0))
    engine.pool.used = state.get("usage", 0.0)
    for name, value in state.items():
        if hasattr(engine.stats, name):
            setattr(engine.stats, name, value)
    replica.started_at = state.get("started_at", replica.started_at)

    assert page.render() == library_page(replica)


def test_the_page_carries_vllms_families_with_their_values() -> None:
    replica = fake_replica()
    page = MetricsPage(replica)  # type: ignore[arg-type]
    replica.engine.waiting = [object()] * 4
    replica.engine.stats.prompt_tokens = 1_000
    samples = {
        s.name: s for family in text_string_to_metric_families(page.render().decode()) for s in family.samples
    }
    assert samples["vllm:num_requests_waiting"].value == 4
    assert samples["vllm:num_requests_waiting"].labels == {"model_name": "org/model-7b", "engine": "0"}
    assert samples["vllm:prompt_tokens_total"].value == 1_000
    assert samples["vllm:request_success_total"].labels["finished_reason"] == "length"
    assert samples["vllm:cache_config_info"].labels["block_size"] == "16"
    assert samples["process_start_time_seconds"].value == pytest.approx(1_796_660_587.123456)
