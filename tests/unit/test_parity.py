"""The parity monitor: kvgate's prompt counts and cache credits against the engine's, the fall back to approximate
routing when they keep disagreeing, and the way back."""

from __future__ import annotations

from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.routing.config import ParityConfig
from kvgate.router.routing.parity import ParityMonitor, Sample


def sample(counted: int | None, engine: int, credited: int = 0, cached: int | None = None) -> Sample:
    return Sample(model="m", api="chat", request_id="r", counted=counted, engine_prompt=engine, credited=credited,
                  engine_cached=cached, block_size=16)


def counter(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_a_model_whose_counts_keep_disagreeing_is_untrusted_then_trusted_again() -> None:
    metrics = GatewayMetrics()
    monitor = ParityMonitor(ParityConfig(window=8, untrust_after=3, recover_after=4), metrics)
    assert monitor.trusted("m")
    for _ in range(2):
        monitor.observe(sample(100, 103))
    assert monitor.trusted("m")  # two mismatches are not yet persistent
    monitor.observe(sample(100, 103))
    assert not monitor.trusted("m")
    assert counter(metrics, "kvgate_parity_prompt_tokens_total", model="m", api="chat", result="mismatch") == 3
    for _ in range(3):
        monitor.observe(sample(100, 100))
    assert not monitor.trusted("m")  # three agreeing counts are not yet four in a row
    monitor.observe(sample(100, 103))  # a mismatch breaks the streak
    for _ in range(3):
        monitor.observe(sample(100, 100))
    assert not monitor.trusted("m")
    monitor.observe(sample(100, 100))
    assert monitor.trusted("m")
    assert monitor.stats() == {"trusted": {"m": 1.0}}
    state = monitor.state()["m"]
    assert state["last_mismatch"] == {"request_id": "r", "api": "chat", "kvgate_prompt_tokens": 100,
                                      "engine_prompt_tokens": 103}


def test_counts_that_are_not_kvgates_own_never_untrust() -> None:
    monitor = ParityMonitor(ParityConfig(window=4, untrust_after=1, recover_after=1), GatewayMetrics())
    for _ in range(10):
        monitor.observe(sample(None, 103))  # approximate or engine-tokenized: nothing to compare
    assert monitor.trusted("m")


def test_cache_credits_are_compared_within_a_block() -> None:
    metrics = GatewayMetrics()
    monitor = ParityMonitor(ParityConfig(), metrics)
    monitor.observe(sample(100, 100, credited=64, cached=64))
    monitor.observe(sample(100, 100, credited=64, cached=60))  # within a block: the same reuse
    monitor.observe(sample(100, 100, credited=96, cached=64))
    monitor.observe(sample(100, 100, credited=0, cached=32))
    monitor.observe(sample(100, 100, credited=32, cached=None))  # the engine does not say: no comparison
    assert monitor.state()["m"]["cached_tokens"] == {"match": 2, "credited_not_reused": 1, "reused_not_credited": 1}
    assert counter(metrics, "kvgate_parity_cached_tokens_total", model="m", api="chat",
                   result="credited_not_reused") == 1
