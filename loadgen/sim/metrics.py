"""A replica's ``/metrics``: vLLM's Prometheus names, read from the engine's live state at scrape time, plus the
standard ``process_start_time_seconds`` of the replica's (simulated) engine process, which a restart changes."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .replica import SimReplica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ReplicaCollector:
    """Yields the metrics vLLM's ``PrometheusStatLogger`` exports (labels ``model_name`` and ``engine``)."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        engine = self.replica.engine
        params = self.replica.params
        labels = ["model_name", "engine"]
        values = [params.model, "0"]
        s = engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.pool.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries",
                      "External prefix cache queries from KV connector cross-instance cache sharing.",
                      s.external_prefix_cache_queries)
        yield counter("vllm:external_prefix_cache_hits",
                      "External prefix cache hits from KV connector cross-instance cache sharing.",
                      s.external_prefix_cache_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      s.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        finished = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                       labels=[*labels, "finished_reason"])
        finished.add_metric([*values, "length"], s.requests_completed)  # the sim stops only at max_tokens
        yield finished
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
                    "prefix_caching_hash_algo", "engine"],
        )
        info.add_metric(
            [str(params.block_size), str(params.kv_blocks), str(params.cpu_blocks), "True", "sha256", "0"], 1.0
        )
        yield info
        yield GaugeMetricFamily("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", value=self.replica.started_at)


def metrics_registry(replica: SimReplica) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(replica))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
