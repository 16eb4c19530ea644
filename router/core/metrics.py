"""The gateway's Prometheus metrics, on a registry owned by the app (several apps can live in one test process).

Request-path metrics are counted on the event loop without locks (:class:`LoopCounter`, :class:`LoopHistogram`) and
exported when scraped. Everything that is already counted elsewhere (the fleet's in-flight numbers and
breaker states, the index's and ingestor's counters, the tokenizer's counters, the cost model's coefficients, reload
and replication counters) is read at scrape time by collectors, so the request path pays nothing for it.

Prefill savings are priced by the cost model (:meth:`kvgate.policies.cost_model.CostModel.prefill_avoided_ms`): the
engines do not report prefill time, so "what caching paid" is the model's prefill of the work that was skipped.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvgate.cache_index.ingest import DROP_REASONS

log = logging.getLogger(__name__)

disable_created_metrics()  # process-wide: the *_created series double every counter's output and nobody reads them

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LOOKUP_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Prompt-token counts per request; the ``le="0"`` bucket counts requests that matched nothing."""
BREAKER_STATES = ("closed", "open", "half_open")
TRANSFER_RESULTS = ("started", "completed", "failed", "fallback")
TRANSFER_KINDS = ("transfer", "disaggregated")
"""What a handshake was for: a warm prefix pulled from a replica holding it (a routed transfer or a warm-up), or a
disaggregated request's prefill leg on a prefill replica."""


class LoopCounter(Collector):
    """A counter, with or without labels, counted on the event loop and exported when scraped.

    prometheus_client's ``Counter`` takes a lock on every increment and checks its arguments on every ``labels()``;
    the request path increments several counters per request, all from the event loop (as ``/metrics`` reads them),
    so here an increment is an addition to a float and a label set a dictionary look-up."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.value = 0.0
        self._children: dict[tuple[str, ...], LoopCounter] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> LoopCounter:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes {len(self.labelnames)} label values")
            child = self._children[values] = LoopCounter(self.name, self.documentation)
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames or None)]

    def collect(self) -> Iterator[Metric]:
        if not self.labelnames:
            yield CounterMetricFamily(self.name, self.documentation, value=self.value)
            return
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(values, child.value)
        yield family


class LoopHistogram(Collector):
    """A histogram, with or without labels, observed on the event loop and exported when scraped (as
    :class:`LoopCounter`: no lock; the bucket found by bisection, not by a scan of the bounds)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        """Observations per bucket (not cumulative), the last one's above every bound."""
        self.sum = 0.0
        self._children: dict[tuple[str, ...], LoopHistogram] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> LoopHistogram:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes {len(self.labelnames)} label values")
            child = self._children[values] = LoopHistogram(self.name, self.documentation, buckets=self.bounds)
        return child

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames or None)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames or None)
        children = self._children.items() if self.labelnames else [((), self)]
        for values, child in children:
            family.add_metric(list(values), child._buckets(), child.sum)
        yield family

    def _buckets(self) -> list[tuple[str, float]]:
        cumulative = list(accumulate(self.counts))
        return [(floatToGoString(bound), float(n)) for bound, n in zip(self.bounds, cumulative)] + \
            [("+Inf", float(cumulative[-1]))]


class GatewayMetrics:
    """Every metric object the gateway updates on the request path."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = LoopCounter(
            "kvgate_requests", "Requests answered, by replica, HTTP status and routing decision reason.",
            ["replica", "status", "decision"], registry=r,
        )
        self.rejections = LoopCounter(
            "kvgate_rejections", "Requests kvgate answered itself with an error (bad input, auth, no replica).",
            ["reason"], registry=r,
        )
        self.retries = LoopCounter(
            "kvgate_retries", "Upstream attempts retried on another replica, by cause.", ["cause"], registry=r
        )
        self.upstream_failures = LoopCounter(
            "kvgate_upstream_failures", "Upstream attempts that failed before any byte reached the client, by "
            "replica and cause (timeout: no first byte within the deadline; connect; disconnect; status_5xx/429).",
            ["replica", "cause"], registry=r,
        )
        self.waits_past_deadline = LoopCounter(
            "kvgate_upstream_waits_past_deadline", "Upstream attempts answered after their first-byte deadline, "
            "which was put off because the replica kept answering other requests meanwhile (a busy queue, not a "
            "fault).", ["replica"], registry=r,
        )
        self.stream_errors = LoopCounter(
            "kvgate_stream_errors", "Streams ended with an error event after the first byte reached the client.",
            registry=r,
        )
        self.client_disconnects = LoopCounter(
            "kvgate_client_disconnects", "Requests whose client left before the response completed.", registry=r
        )
        self.decisions = LoopCounter(
            "kvgate_decisions", "Routing decisions by action and reason.", ["action", "reason"], registry=r
        )
        self.routed_on_beginning = LoopCounter(
            "kvgate_routed_on_prompt_beginning", "Requests routed on their prompt's beginning while the rest of it "
            "was tokenized (a long prompt new to the gateway, no cached prefix reaching past that beginning).",
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvgate_ttft_seconds", "Time to first token (first streamed chunk; streaming requests only).",
            ["cache"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = LoopHistogram(
            "kvgate_e2e_seconds", "End-to-end request latency as seen by kvgate.", ["cache"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.route_seconds = LoopHistogram(
            "kvgate_route_seconds", "Time to tokenize, look up and decide (before any upstream call).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r,
        )
        self.lookup_seconds = LoopHistogram(
            "kvgate_index_lookup_seconds", "Prefix-index lookup of one prompt's block keys (the lookup alone).",
            buckets=LOOKUP_BUCKETS, registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvgate_prompt_tokens", "Prompt tokens of completed requests (engine-reported usage).", registry=r
        )
        self.cached_tokens = LoopCounter(
            "kvgate_cached_tokens", "Prompt tokens the engine served from its prefix cache (usage).", registry=r
        )
        self.matched_tokens = LoopHistogram(
            "kvgate_matched_tokens", "Leading prompt tokens the index matched on the replica that served the "
            "request, per completed request.", buckets=TOKEN_BUCKETS, registry=r,
        )
        self.prefill_avoided = LoopCounter(
            "kvgate_prefill_avoided_seconds", "Prefill the engines skipped on completed requests, priced at "
            "completion by the cost model from the engine's usage cached tokens (the index's match when the "
            "response carried no usage).", registry=r,
        )
        self.parity_prompt = LoopCounter(
            "kvgate_parity_prompt_tokens", "Answered requests whose prompt kvgate tokenized itself, by model, API and "
            "whether its prompt token count equals the engine's (match, mismatch): a mismatch means its block keys "
            "are not the engine's.", ["model", "api", "result"], registry=r,
        )
        self.parity_cached = LoopCounter(
            "kvgate_parity_cached_tokens", "Answered requests whose engine reported cached tokens, by model, API and "
            "how kvgate's credit compared (match within a block; credited_not_reused: kvgate counted on a cache the "
            "engine did not use; reused_not_credited).", ["model", "api", "result"], registry=r,
        )
        self.admission_wait = LoopHistogram(
            "kvgate_admission_wait_seconds", "Time requests waited at the gateway for capacity (released ones), by "
            "priority band and tenant.", ["band", "tenant"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.admission_refusals = LoopCounter(
            "kvgate_admission_refusals", "Requests admission refused or lost, by reason: rate_limit_requests, "
            "rate_limit_tokens, rate_limit_concurrency (429); queue_full, deadline (503); client_left (the client "
            "went away while it waited).", ["reason"], registry=r,
        )
        self.admission_tokens = LoopCounter(
            "kvgate_admission_admitted_tokens", "Prompt tokens admitted, by tenant.", ["tenant"], registry=r,
        )
        self.warmup_tokens = LoopCounter(
            "kvgate_warmup_tokens", "Prompt tokens prefilled by hot-prefix warm-ups (work spent on replication).",
            registry=r,
        )
        transfers = LoopCounter(
            "kvgate_transfers", "KV handshakes by kind (transfer: a warm prefix pulled, for a request or a warm-up; "
            "disaggregated: a request prefilled on a prefill replica) and result: started (first leg sent), "
            "completed (destination answered 200 with the pulled KV), failed (destination failed after the "
            "handshake), fallback (first leg failed or timed out: recomputed instead).", ["kind", "result"],
            registry=r,
        )
        self.transfers = {
            (kind, result): transfers.labels(kind, result) for kind in TRANSFER_KINDS for result in TRANSFER_RESULTS
        }
        transfer_bytes = LoopCounter(
            "kvgate_transfer_bytes", "KV bytes handed over by completed handshakes, by kind (tokens the destination "
            "lacked x kv_bytes_per_token, the cost model's estimate).", ["kind"], registry=r,
        )
        self.transfer_bytes = {kind: transfer_bytes.labels(kind) for kind in TRANSFER_KINDS}
        transfer_prefill_avoided = LoopCounter(
            "kvgate_transfer_prefill_avoided_seconds", "Prefill destinations skipped thanks to completed "
            "handshakes, by kind (cost model). Divided by kvgate_transfer_bytes_total: saved prefill per byte moved.",
            ["kind"], registry=r,
        )
        self.transfer_prefill_avoided = {kind: transfer_prefill_avoided.labels(kind) for kind in TRANSFER_KINDS}
        transfer_seconds = LoopHistogram(
            "kvgate_transfer_seconds", "Handshake first leg (prefill-only request on the source) duration, by kind "
            "and result: completed (kv_transfer_params returned) or fallback.", ["kind", "result"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.transfer_seconds = {
            (kind, result): transfer_seconds.labels(kind, result)
            for kind in TRANSFER_KINDS for result in ("completed", "fallback")
        }

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def add_stats(self, source: Callable[[], object], series: Iterable[Series]) -> None:
        """Export fields of a component's stats (an object or a mapping, read at scrape time) as ``series``."""
        self.registry.register(StatsCollector(source, series))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class Series:
    """How one field of a component's stats is exported."""

    name: str
    field: str
    kind: Literal["counter", "gauge"]
    help: str
    label: str | None = None
    """For a ``{label value: number}`` field: the label's name."""
    always: tuple[str, ...] = ()
    """Label values exported as 0 before they are first counted, so dashboards and alerts see them from the start."""


class StatsCollector(Collector):
    """Turns the fields of a component's stats into counters and gauges.

    A field missing from the stats is exported with no sample (or with its ``always`` zeros). A source that raises
    is logged and skipped, so one broken component never breaks ``/metrics``.
    """

    def __init__(self, source: Callable[[], object], series: Iterable[Series]) -> None:
        self.source = source
        self.series = tuple(series)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.source()
        except Exception:
            log.exception("stats source for %s failed", self.series[0].name if self.series else "?")
            return
        for s in self.series:
            value = stats.get(s.field) if isinstance(stats, Mapping) else getattr(stats, s.field, None)
            family_type = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
            if s.label is None:
                if isinstance(value, (int, float)):
                    yield family_type(s.name, s.help, value=float(value))
                continue
            family = family_type(s.name, s.help, labels=[s.label])
            values: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
            for key in s.always:
                if key not in values:
                    family.add_metric([key], 0.0)
            for key, v in values.items():
                family.add_metric([str(key)], float(v))
            yield family


INDEX_SERIES = (
    Series("kvgate_index_entries", "entries", "gauge", "(block, replica, tier) holdings confirmed by KV events."),
    Series("kvgate_index_blocks", "blocks", "gauge", "Distinct block keys held by at least one replica."),
    Series("kvgate_index_approx_bytes", "approx_bytes", "gauge", "Estimated memory of the index's holdings."),
    Series("kvgate_index_evictions", "evictions", "counter", "Holdings evicted because the index hit max_entries."),
    Series("kvgate_index_predicted_entries", "predicted_entries", "gauge",
           "Predicted (block, replica) holdings awaiting an event or their TTL."),
    Series("kvgate_index_replicas", "replicas", "gauge", "Replicas the index tracks."),
)
HINT_SERIES = (
    Series("kvgate_peer_hints_published", "published", "counter",
           "Routing hints (predictions, warm-ups started) published to peer gateways."),
    Series("kvgate_peer_hints_applied", "applied", "counter", "Peer gateways' routing hints taken in."),
    Series("kvgate_peer_hints_dropped", "dropped", "counter",
           "Peer gateways' routing hints dropped: malformed, past their TTL, or naming an unknown replica."),
    Series("kvgate_peer_work_published", "work_published", "counter",
           "Reports of this gateway's dispatched work published to peer gateways."),
    Series("kvgate_peer_work_applied", "work_applied", "counter",
           "Peer gateways' work reports taken in (each counts until peers.hints.work_ttl_s)."),
    Series("kvgate_peer_work_dropped", "work_dropped", "counter",
           "Peer gateways' work reports refused: past their TTL, out of order, or out of bounds."),
)
INGEST_SERIES = (
    Series("kvgate_events_applied", "events_applied", "counter", "KV events applied to the index."),
    Series("kvgate_events_frames_applied", "frames_applied", "counter", "KV-event frames (batches) applied."),
    Series("kvgate_events_dropped", "dropped", "counter", "KV events or frames not applied, by reason.",
           label="reason", always=DROP_REASONS),
    Series("kvgate_events_unknown_fields", "unknown_fields", "counter", "Event fields kvgate does not know (ignored)."),
    Series("kvgate_events_unknown_removed", "unknown_removed", "counter",
           "BlockRemoved hashes never seen stored (e.g. stored before kvgate subscribed): nothing to do."),
    Series("kvgate_events_gaps_detected", "gaps_detected", "counter", "Sequence gaps in a replica's event stream."),
    Series("kvgate_events_replays_requested", "replays_requested", "counter", "Replays asked of replay endpoints."),
    Series("kvgate_events_replays_succeeded", "replays_succeeded", "counter", "Replays that repaired their gap."),
    Series("kvgate_events_replays_failed", "replays_failed", "counter", "Replays unavailable or not covering a gap."),
    Series("kvgate_events_purges", "purges", "counter", "Replica holdings dropped because a gap was not repaired."),
    Series("kvgate_events_restarts", "restarts", "counter", "Engine restarts seen (sequence went backwards, or "
           "the scraped process start time moved)."),
    Series("kvgate_events_resets", "resets", "counter", "Replica holdings dropped (new generation), by reason.",
           label="reason"),
    Series("kvgate_events_generation", "generations", "gauge", "Cache-state generation of each replica in the "
           "index: moves on every restart, AllBlocksCleared and reset (what explain reports).", label="replica"),
)
TOKENIZER_SERIES = (
    Series("kvgate_tokenizer_prompts", "by_source", "counter", "Prompts tokenized, by source.", label="source",
           always=("local", "engine", "approximate", "ids")),
    Series("kvgate_tokenizer_engine_errors", "engine_errors", "counter",
           "Engine /tokenize fallbacks that failed (each fell back to approximate)."),
    Series("kvgate_tokenizer_local_errors", "local_errors", "counter", "Unexpected local tokenizer failures."),
    Series("kvgate_tokenizer_cpu_seconds", "cpu_seconds", "counter", "CPU time spent tokenizing."),
    Series("kvgate_tokenizer_cache_hits", "cache_hits", "counter", "Tokenization cache hits (messages, pieces)."),
    Series("kvgate_tokenizer_cache_misses", "cache_misses", "counter", "Tokenization cache misses."),
    Series("kvgate_tokenizer_cache_evictions", "cache_evictions", "counter", "Tokenization cache evictions."),
    Series("kvgate_tokenizer_cache_entries", "cache_entries", "gauge", "Tokenization cache entries."),
    Series("kvgate_tokenizer_cache_bytes", "cache_bytes", "gauge", "Tokenization cache size (bytes)."),
)
CONFIG_SERIES = (
    Series("kvgate_config_reloads_ok", "reloads_ok", "counter", "Policy-file reloads applied."),
    Series("kvgate_config_reloads_rejected", "reloads_rejected", "counter", "Policy-file reloads rejected (invalid)."),
)
PREFILL_SERIES = (
    Series("kvgate_prefill_fixed_ms", "fixed_ms", "gauge", "Prefill cost in force (calibrated or the policy "
           "file's): fixed ms per request, by model.", label="model"),
    Series("kvgate_prefill_per_token_ms", "per_token_ms", "gauge", "Prefill cost in force: ms per uncached token, "
           "by model.", label="model"),
    Series("kvgate_prefill_quadratic_ms", "quadratic_ms", "gauge", "Prefill cost in force: quadratic ms per "
           "million token pairs (long contexts), by model.", label="model"),
    Series("kvgate_queue_scale", "queue_scale", "gauge", "Queue-delay scale in force (calibrated or the policy "
           "file's): the share of the work counted ahead of a request that it waits for, by model.", label="model"),
)
BLOCK_SIZE_SERIES = (
    Series("kvgate_replica_block_size", "block_size", "gauge", "KV block size (tokens) a replica's lookups are keyed "
           "with: "
           "its events' or scraped cache_config_info's, else the policy file's.", label="replica"),
    Series("kvgate_block_size_mismatch", "mismatch", "gauge", "1 while a replica's engine uses another block size "
           "than the policy file states for its model (the engine's is used).", label="replica"),
)
PARITY_SERIES = (
    Series("kvgate_parity_trusted", "trusted", "gauge", "1 while kvgate trusts its exact block keys for a model; 0 "
           "once its prompt token counts disagree with the engine's persistently (routed as approximate then).",
           label="model"),
)
REPLICATION_SERIES = (
    Series("kvgate_replication_started", "started", "counter", "Hot-prefix warm-ups started, by reason.",
           label="reason", always=("hot-prefix",)),
    Series("kvgate_replication_retired", "retired", "counter", "Warmed replicas no longer counted for their prefix, "
           "by reason.", label="reason", always=("cooled",)),
    Series("kvgate_replication_failed", "failed", "counter", "Warm-ups that failed, by reason.", label="reason",
           always=("timeout", "reported")),
    Series("kvgate_replication_skipped", "skipped", "counter", "Hot prefixes passed over in a planning round, "
           "by reason.", label="reason", always=("cap", "budget")),
)


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
        generation = GaugeMetricFamily(
            "kvgate_replica_generation", "Health generation (moves when a replica recovers from health loss); "
            "the index's cache-state generation is kvgate_events_generation.", labels=["replica"],
        )
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
