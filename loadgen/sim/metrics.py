"""A replica's ``/metrics``: vLLM's Prometheus names, read from the engine's live state at scrape time, plus the
standard ``process_start_time_seconds`` of the replica's (simulated) engine process, which a restart changes.

A real engine serves ``/metrics`` from its API server, not from the process that drives the GPU, so a scrape never
delays its steps. Here every replica's engine shares one process with its HTTP server, and a gateway scraping 8
replicas ten times a second would spend the fleet's CPU on rendering pages. So the page is rendered by
prometheus_client once, at start, and cut into the text before each sample's value (:class:`MetricsPage`); a scrape
only formats the values into it, as prometheus_client formats them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .replica import SimReplica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family with a single sample, and where its value is read."""

    name: str
    kind: str  # "gauge" or "counter"
    documentation: str
    value: Callable[[SimReplica], float]


FAMILIES: tuple[Family, ...] = (
    Family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           lambda r: len(r.engine.running)),
    Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           lambda r: len(r.engine.waiting)),
    Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           lambda r: r.engine.pool.usage()),
    Family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
           lambda r: r.engine.stats.prefix_cache_queries),
    Family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           lambda r: r.engine.stats.prefix_cache_hits),
    Family("vllm:external_prefix_cache_queries", "counter",
           "External prefix cache queries from KV connector cross-instance cache sharing.",
           lambda r: r.engine.stats.external_prefix_cache_queries),
    Family("vllm:external_prefix_cache_hits", "counter",
           "External prefix cache hits from KV connector cross-instance cache sharing.",
           lambda r: r.engine.stats.external_prefix_cache_hits),
    Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
           lambda r: r.engine.stats.prompt_tokens),
    Family("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external).",
           lambda r: r.engine.stats.prompt_tokens_cached),
    Family("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
           lambda r: r.engine.stats.generation_tokens),
)
"""The families vLLM's ``PrometheusStatLogger`` exports (labels ``model_name`` and ``engine``) that the sim has."""


class ReplicaCollector:
    """The page's families as prometheus_client metric families, with their values at collection time."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        replica, params = self.replica, self.replica.params
        values = [params.model, "0"]
        for family in FAMILIES:
            kind = GaugeMetricFamily if family.kind == "gauge" else CounterMetricFamily
            metric = kind(family.name, family.documentation, labels=list(LABELS))
            metric.add_metric(values, family.value(replica))
            yield metric
        finished = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                       labels=[*LABELS, "finished_reason"])
        finished.add_metric([*values, "length"], _requests_completed(replica))  # the sim stops only at max_tokens
        yield finished
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
                    "prefix_caching_hash_algo", "engine"],
        )
        info.add_metric(
            [str(params.block_size), str(params.kv_blocks), str(params.cpu_blocks), "True", "sha256", "0"],
            _cache_config(replica),
        )
        yield info
        yield GaugeMetricFamily("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", value=_started_at(replica))


def _requests_completed(replica: SimReplica) -> float:
    return replica.engine.stats.requests_completed


def _cache_config(replica: SimReplica) -> float:
    return 1.0  # an info gauge: what it says is in its labels


def _started_at(replica: SimReplica) -> float:
    return replica.started_at


VALUES: tuple[Callable[[SimReplica], float], ...] = (
    *(family.value for family in FAMILIES), _requests_completed, _cache_config, _started_at
)
"""Every sample's value, in the order :meth:`ReplicaCollector.collect` yields them."""


class MetricsPage:
    """``replica``'s page: prometheus_client's rendering of :class:`ReplicaCollector`, cut once into the text before
    each sample's value, which a scrape fills in with the values of the moment."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ReplicaCollector(replica))
        self._before_value = _cut_before_values(generate_latest(registry).decode())
        assert len(self._before_value) == len(VALUES)

    def render(self) -> bytes:
        replica = self.replica
        return "".join(
            f"{text}{floatToGoString(value(replica))}\n" for text, value in zip(self._before_value, VALUES)
        ).encode()


def _cut_before_values(page: str) -> list[str]:
    """For each sample line of an exposition page, the text from the previous sample's value to this one's (its
    HELP and TYPE lines, its name and labels): the page is these, each followed by its value and a newline."""
    cuts: list[str] = []
    pending = ""
    for line in page.splitlines(keepends=True):
        if line.startswith("#"):
            pending += line
        else:
            cuts.append(pending + line[: line.rindex(" ") + 1])
            pending = ""
    assert not pending, "the page ends with a sample"
    return cuts
