"""The gateway's Prometheus metrics, on a registry owned by the app (several apps can live in one test process).

Request-path metrics are updated as requests complete. Everything that is already counted elsewhere (the fleet's
in-flight numbers and breaker states, the index's and ingestor's counters, the tokenizer's counters, the cost model's
coefficients, reload counters) is read at scrape time by collectors, so the request path pays nothing for it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvgate.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BREAKER_STATES = ("closed", "open", "half_open")

StatsValue = float | int | bool | Mapping[str, float | int]
StatsSource = Callable[[], Mapping[str, StatsValue]]


class GatewayMetrics:
    """Every metric object the gateway updates on the request path."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Requests answered, by replica, HTTP status and routing decision reason.",
            ["replica", "status", "decision"], registry=r,
        )
        self.rejections = Counter(
            "kvgate_rejections", "Requests kvgate answered itself with an error (bad input, auth, no replica).",
            ["reason"], registry=r,
        )
        self.retries = Counter(
            "kvgate_retries", "Upstream attempts retried on another replica, by cause.", ["cause"], registry=r
        )
        self.stream_errors = Counter(
            "kvgate_stream_errors", "Streams ended with an error event after the first byte reached the client.",
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvgate_client_disconnects", "Requests whose client left before the response completed.", registry=r
        )
        self.decisions = Counter(
            "kvgate_decisions", "Routing decisions by action and reason.", ["action", "reason"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "Time to first token (first streamed chunk; streaming requests only).",
            ["cache"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvgate_e2e_seconds", "End-to-end request latency as seen by kvgate.", ["cache"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.route_seconds = Histogram(
            "kvgate_route_seconds", "Time to tokenize, look up and decide (before any upstream call).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens of completed requests (engine-reported usage).", registry=r
        )
        self.cached_tokens = Counter(
            "kvgate_cached_tokens", "Prompt tokens the engine served from its prefix cache (usage).", registry=r
        )
        self.matched_tokens = Counter(
            "kvgate_matched_tokens", "Leading prompt tokens the index matched on the chosen replica.", registry=r
        )
        self.warmup_tokens = Counter(
            "kvgate_warmup_tokens", "Prompt tokens prefilled by hot-prefix warm-ups (work spent on replication).",
            registry=r,
        )
        self.transfers = Counter(
            "kvgate_transfers", "KV transfer handshakes by result (completed, fallback).", ["result"], registry=r
        )

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def add_stats(self, prefix: str, source: StatsSource, help_text: str) -> None:
        """Export a component's plain counters (read at scrape time) as ``<prefix>_<field>`` gauges."""
        self.registry.register(StatsCollector(prefix, source, help_text))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


class StatsCollector(Collector):
    """Turns a mapping of numbers (and of ``{label: number}`` maps) into gauges.

    A nested mapping becomes one gauge with a ``key`` label, e.g. events dropped by reason. A source that raises is
    logged and skipped, so one broken component never breaks ``/metrics``.
    """

    def __init__(self, prefix: str, source: StatsSource, help_text: str) -> None:
        self.prefix = prefix
        self.source = source
        self.help_text = help_text

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.source()
        except Exception:
            log.exception("stats source %s failed", self.prefix)
            return
        for field, value in stats.items():
            name = f"{self.prefix}_{_NAME_UNSAFE.sub('_', field)}"
            if isinstance(value, Mapping):
                family = GaugeMetricFamily(name, f"{self.help_text}: {field}", labels=["key"])
                for key, v in value.items():
                    family.add_metric([str(key)], float(v))
                yield family
            elif isinstance(value, (int, float)):
                yield GaugeMetricFamily(name, f"{self.help_text}: {field}", value=float(value))


class ReplicaStateCollector(Collector):
    """Per-replica gauges read from the live fleet: in-flight work, health, breaker state, generation."""

    def __init__(self, replicas: Callable[[], Iterable[Any]]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("kvgate_in_flight", "Requests dispatched and not complete.", labels=["replica"])
        prefill = GaugeMetricFamily(
            "kvgate_in_flight_prefill_tokens", "Uncached prompt tokens awaiting first token.", labels=["replica"]
        )
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 when health checks pass.", labels=["replica"])
        draining = GaugeMetricFamily("kvgate_replica_draining", "1 while draining.", labels=["replica"])
        generation = GaugeMetricFamily("kvgate_replica_generation", "Cache-state generation.", labels=["replica"])
        breaker = GaugeMetricFamily(
            "kvgate_breaker_state", "Circuit breaker state (1 for the current one).", labels=["replica", "state"]
        )
        for rep in self.replicas():
            in_flight.add_metric([rep.name], rep.in_flight)
            prefill.add_metric([rep.name], rep.in_flight_prefill_tokens)
            healthy.add_metric([rep.name], 1.0 if rep.healthy else 0.0)
            draining.add_metric([rep.name], 1.0 if rep.draining else 0.0)
            generation.add_metric([rep.name], rep.generation)
            state = rep.breaker.state
            for s in BREAKER_STATES:
                breaker.add_metric([rep.name, s], 1.0 if s == state else 0.0)
        yield from (in_flight, prefill, healthy, draining, generation, breaker)
