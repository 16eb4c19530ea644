"""Turn request records into the numbers a user compares: latency percentiles, throughput, hit ratio against the
oracle, load imbalance; then policies side by side with ratios to the best baseline, as results.json, report.md and
a terminal table.

One noisy run per policy cannot carry a claim, so ``kvgate bench --repeat N`` runs every policy N times and this
module reduces the repeats: per run, each metric's median (a summary of the same shape as one run's, so the ratios to
the best baseline are computed on medians exactly as for one run), its min and max, and the candidate's paired wins
(repeat k of the candidate against repeat k of each baseline).

results.json layout. One repeat (``kvgate loadgen``, ``kvgate bench`` by default)::

    {"meta": {...},                              # workload, seed, argv, "targets": {run: url}, ...
     "summaries": {run: summary},                # summarize() of each run, plus CPU seconds and gateway counters
     "ratios_to_best_baseline": {metric: {...}}, # compare() of the summaries
     "requests": {run: [record, ...]}}           # every request of every run

Several repeats (``kvgate bench --repeat N``, N > 1)::

    {"meta": {..., "repeats": N},                # no "targets": each repeat has its own
     "summaries": {run: summary},                # medians across repeats (median_summaries)
     "ranges": {run: {metric: [min, max]}},      # across repeats, metrics with a value in some repeat
     "ratios_to_best_baseline": {metric: {...}}, # compare() of the medians
     "wins_per_repeat": [PairedWins.to_json()],  # candidate vs each baseline, repeat by repeat
     "repeats": [{"repeat": k, "order": [run, ...], "targets": {run: url},
                  "summaries": {run: summary}, "ratios_to_best_baseline": {...},
                  "requests": {run: [record, ...]}}, ...]}
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from kvgate.loadgen.copies import copies_audit, copies_lines
from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.workloads.oracle import IdealPrefill
from kvgate.loadgen.workloads.request import Request

CANDIDATE = "cost"
TIE_TOLERANCE = 0.01
"""Paired results within 1% of each other are a tie: e.g. two p99s both at the cold-prefill floor differ by a
fraction of a millisecond of scheduling, which is no win."""
TIMELINE_SAMPLES = 400


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    better: Literal["lower", "higher"]
    unit: str = ""


METRICS: tuple[Metric, ...] = (
    Metric("ttft_mean_ms", "TTFT mean", "lower", "ms"),
    Metric("ttft_p50_ms", "TTFT p50", "lower", "ms"),
    Metric("ttft_p90_ms", "TTFT p90", "lower", "ms"),
    Metric("ttft_p99_ms", "TTFT p99", "lower", "ms"),
    Metric("engine_ttft_mean_ms", "engine TTFT mean (model clock)", "lower", "ms"),
    Metric("engine_ttft_p99_ms", "engine TTFT p99 (model clock)", "lower", "ms"),
    Metric("oracle_ttft_mean_ms", "oracle TTFT mean (ideal router)", "lower", "ms"),
    Metric("oracle_ttft_p99_ms", "oracle TTFT p99 (ideal router)", "lower", "ms"),
    Metric("engine_ttft_vs_oracle", "engine TTFT mean / oracle", "lower"),
    Metric("ttft_vs_oracle", "TTFT mean / oracle", "lower"),
    Metric("e2e_mean_ms", "E2E mean", "lower", "ms"),
    Metric("e2e_p50_ms", "E2E p50", "lower", "ms"),
    Metric("e2e_p90_ms", "E2E p90", "lower", "ms"),
    Metric("e2e_p99_ms", "E2E p99", "lower", "ms"),
    Metric("itl_mean_ms", "ITL mean", "lower", "ms"),
    Metric("itl_p99_ms", "ITL p99", "lower", "ms"),
    Metric("engine_itl_mean_ms", "engine ITL mean (model clock)", "lower", "ms"),
    Metric("engine_itl_p99_ms", "engine ITL p99 (model clock)", "lower", "ms"),
    Metric("engine_itl_p999_ms", "engine ITL p99.9 (model clock)", "lower", "ms"),
    Metric("throughput_rps", "throughput", "higher", "req/s"),
    Metric("output_tok_s", "output", "higher", "tok/s"),
    Metric("hit_ratio", "cache hit ratio", "higher"),
    Metric("oracle_hit_ratio", "oracle hit ratio", "higher"),
    Metric("load_imbalance", "load imbalance (max/mean)", "lower"),
    Metric("evicted_tokens", "KV tokens evicted (engines)", "lower"),
    Metric("prefill_tokens_computed", "prompt tokens prefilled (engines)", "lower"),
    Metric("first_legs_served", "first legs served (engines)", "lower"),
    Metric("transfers_in", "KV pulls (engines)", "lower"),
    Metric("off_role_requests", "requests off their replica's role (engines)", "lower"),
    Metric("send_lag_mean_ms", "client send lag mean", "lower", "ms"),
    Metric("router_cpu_s", "router CPU during run", "lower", "s"),
    Metric("sim_cpu_s", "sim CPU during run", "lower", "s"),
    Metric("errors", "errors", "lower"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default); nan if empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def inflight_timeline(
    intervals: Iterable[tuple[str, float, float]], replicas: Sequence[str], samples: int = TIMELINE_SAMPLES
) -> tuple[list[float], dict[str, list[int]]]:
    """In-flight requests per replica at ``samples`` evenly spaced instants over the run, from each request's
    (replica, start, end) interval. A replica that got nothing still appears, with zeros."""
    spans = list(intervals)
    if not spans:
        return [], {r: [] for r in replicas}
    series: dict[str, list[int]] = {r: [0] * samples for r in replicas}
    t_min = min(s for _, s, _ in spans)
    t_max = max(e for _, _, e in spans)
    step = (t_max - t_min) / samples
    times = [t_min + (i + 0.5) * step for i in range(samples)]
    for replica, start, end in spans:
        row = series.setdefault(replica, [0] * samples)
        for i, t in enumerate(times):
            if start <= t < end:
                row[i] += 1
    return times, series


def load_imbalance(series: dict[str, list[int]]) -> float:
    """Time-average of max/mean in-flight across replicas, over the instants when anything was in flight.
    1.0 is perfectly even; N (the replica count) means everything on one replica."""
    if not series:
        return math.nan
    columns = list(zip(*series.values()))
    ratios = [max(c) / (sum(c) / len(c)) for c in columns if sum(c) > 0]
    return _mean(ratios)


def summarize(
    records: Sequence[RequestRecord], replicas: Sequence[str] | None = None, ideal: IdealPrefill = IdealPrefill(),
    requests: Sequence[Request] = (),
) -> dict[str, Any]:
    """The headline numbers of one run. ``replicas`` names the whole fleet (so idle replicas count in the
    imbalance); by default, the replicas seen in responses. The oracle TTFT is ``ideal``'s over every request of
    the workload (sent or not, so it is the same for every router), and each TTFT's ratio to it is mean over
    mean. With the workload's ``requests``, the copies audit (:mod:`kvgate.loadgen.copies`) too."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s * 1000 for r in ok]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    engine_itl = [gap for r in ok for gap in r.engine_itl_ms]
    usage = [r for r in ok if r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in usage)
    cached = sum(r.cached_tokens or 0 for r in usage)
    expected = sum(r.expected_prompt_tokens for r in records)
    oracle = sum(r.oracle_hit_tokens for r in records)
    span = (max(r.end_s for r in records) - min(r.start_s for r in records)) if records else 0.0
    routed = [(r.replica, r.start_s, r.end_s) for r in ok if r.replica]
    fleet = list(replicas) if replicas else sorted({rep for rep, _, _ in routed})
    _, series = inflight_timeline(routed, fleet)
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": span,
        "throughput_rps": len(ok) / span if span > 0 else math.nan,
        "output_tok_s": sum(r.output_tokens for r in ok) / span if span > 0 else math.nan,
        "itl_mean_ms": _mean(itl),
        "itl_p99_ms": percentile(itl, 99),
        "engine_itl_mean_ms": _mean(engine_itl),
        "engine_itl_p99_ms": percentile(engine_itl, 99),
        "engine_itl_p999_ms": percentile(engine_itl, 99.9),
        "send_lag_mean_ms": _mean([(r.start_s - r.arrival_s) * 1000 for r in records]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else math.nan,
        "oracle_hit_ratio": oracle / expected if expected else math.nan,
        "load_imbalance": load_imbalance(series) if routed else math.nan,
        "requests_per_replica": {rep: sum(1 for x, _, _ in routed if x == rep) for rep in fleet},
    }
    engine_ttft = [r.engine_ttft_ms for r in ok if r.engine_ttft_ms is not None]
    oracle_ttft = [ideal.ttft_ms(r.expected_prompt_tokens, r.oracle_hit_tokens) for r in records]
    for name, values in (("ttft", ttft), ("e2e", e2e), ("engine_ttft", engine_ttft), ("oracle_ttft", oracle_ttft)):
        out[f"{name}_mean_ms"] = _mean(values)
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q)
    floor = out["oracle_ttft_mean_ms"]
    for name in ("ttft", "engine_ttft"):
        mean = out[f"{name}_mean_ms"]
        out[f"{name}_vs_oracle"] = mean / floor if floor and not _missing(mean) and not _missing(floor) else math.nan
    out.update(prediction_audit(ok))
    out.update(tail_audit(ok))
    out.update(copies_audit(records, requests, ideal))
    return out


TAIL_SHARE = 0.01
"""The share of requests, slowest first by client TTFT, that the tail audit describes: the ones behind the p99."""


def tail_audit(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Who forms the TTFT tail: the slowest ``TAIL_SHARE`` of requests by client TTFT (at least one), their mean TTFT,
    the mean of it spent in an engine's queue and in the engine altogether (its model clock, where the run has it),
    and their mean prompt against every request's. Behind kvgate, also the mean of it kvgate spent before dispatching
    (its queue, tokenizing, routing) and from dispatch to the engine's first token (wall clock), for the tail and for
    every request. A p99 made of the longest prompts, of queueing at the engines, of waiting before any engine took
    the request (a gateway's queue or CPU, the client's own lag) or of engines running late on a busy machine needs a
    different fix; every router gets the same audit, as far as it can be seen."""
    timed = [r for r in records if r.ttft_s is not None]
    if not timed:
        return {}
    worst = sorted(timed, key=lambda r: r.ttft_s or 0.0, reverse=True)[: max(1, math.ceil(len(timed) * TAIL_SHARE))]
    return {
        "tail_requests": len(worst),
        "tail_ttft_mean_ms": _mean([(r.ttft_s or 0.0) * 1000 for r in worst]),
        "tail_engine_queue_mean_ms": _mean([r.engine_queue_ms for r in worst if r.engine_queue_ms is not None]),
        "tail_engine_ttft_mean_ms": _mean([r.engine_ttft_ms for r in worst if r.engine_ttft_ms is not None]),
        "tail_prompt_tokens_mean": _mean([r.expected_prompt_tokens for r in worst]),
        "prompt_tokens_mean": _mean([r.expected_prompt_tokens for r in timed]),
        "tail_before_dispatch_mean_ms": _before_dispatch_ms(worst),
        "before_dispatch_mean_ms": _before_dispatch_ms(timed),
        "tail_upstream_ttft_mean_ms": _mean([r.upstream_ttft_ms for r in worst if r.upstream_ttft_ms is not None]),
        "upstream_ttft_mean_ms": _mean([r.upstream_ttft_ms for r in timed if r.upstream_ttft_ms is not None]),
    }


def _before_dispatch_ms(records: Sequence[RequestRecord]) -> float:
    """The mean time kvgate held requests before dispatching them (from its request log), NaN behind other routers."""
    return _mean([r.gateway_ttft_ms - r.upstream_ttft_ms for r in records
                  if r.gateway_ttft_ms is not None and r.upstream_ttft_ms is not None])


def tail_lines(summaries: dict[str, dict[str, Any]], medians: bool = False) -> list[str]:
    """One line per run: the tail audit's figures (:func:`tail_audit`)."""
    lines: list[str] = []
    for name, s in summaries.items():
        if _missing(s.get("tail_requests")) or not s["tail_requests"]:
            continue
        line = (f"- {name}: the slowest {s['tail_requests']:.0f} averaged {s['tail_ttft_mean_ms']:,.0f} ms, prompts of "
                f"{s['tail_prompt_tokens_mean']:,.0f} tokens (every request: {s['prompt_tokens_mean']:,.0f})")
        if not _missing(s.get("tail_engine_ttft_mean_ms")):
            line += f"; {s['tail_engine_ttft_mean_ms']:,.0f} ms of it in an engine (model clock)"
            if not _missing(s.get("tail_engine_queue_mean_ms")):
                line += f", {s['tail_engine_queue_mean_ms']:,.0f} ms of that in its queue"
        if not _missing(s.get("tail_before_dispatch_mean_ms")) and not _missing(s.get("tail_upstream_ttft_mean_ms")):
            line += (f"; in kvgate {s['tail_before_dispatch_mean_ms']:,.0f} ms before dispatch (every request: "
                     f"{s['before_dispatch_mean_ms']:,.0f}), then {s['tail_upstream_ttft_mean_ms']:,.0f} ms to the "
                     f"engine's first token (every request: {s['upstream_ttft_mean_ms']:,.0f})")
        lines.append(line)
    heading = (f"Who forms the TTFT tail: the slowest {TAIL_SHARE:.0%} of requests by client TTFT"
               + (" (median across repeats)" if medians else "") + ":")
    return ["", heading, ""] + lines if lines else []


AUDIT_TERMS = ("ttft", "queue", "load", "prefill", "interference")
"""The terms of kvgate's prediction the audit holds to the engine's clock: the TTFT, its queue delay, its load of
cached tiers and the rest (prefill), and the delay the request's prefill imposes on its replica's other arrivals,
which is no part of its own TTFT."""


def prediction_audit(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """kvgate's predictions against the engine's model clock, per term, over the one-leg requests that have both
    sides of it (``audit_compared``: those with a TTFT and queue on both): per term its bias (median of predicted −
    engine) and its mean absolute error. A term that is persistently off shows as a bias; one that predicts nothing
    as an error as large as the term. The load term is compared over the requests that loaded from a cached tier
    on either side (``audit_load_compared``; most load nothing, and their zeros would hide its error) and in total
    (``audit_load_total_ratio``, predicted over the engines'). The interference term is also compared in total
    (``audit_interference_total_ratio``, predicted over imposed): most single requests impose little or nothing,
    and what the term is for is the fleet's sum."""
    timed = [r for r in records if r.predicted_ttft_ms is not None and r.predicted_queue_ms is not None
             and r.engine_ttft_ms is not None and r.engine_queue_ms is not None]
    loaded = [r for r in timed if r.predicted_load_ms is not None and r.engine_load_ms is not None]
    tiered = [r for r in loaded if r.predicted_load_ms or r.engine_load_ms]
    imposing = [r for r in timed if r.predicted_interference_ms is not None and r.engine_interference_ms is not None]
    errors: dict[str, list[float]] = {
        "ttft": [r.predicted_ttft_ms - r.engine_ttft_ms for r in timed],  # type: ignore[operator]
        "queue": [r.predicted_queue_ms - r.engine_queue_ms for r in timed],  # type: ignore[operator]
        "load": [r.predicted_load_ms - r.engine_load_ms for r in tiered],  # type: ignore[operator]
        "prefill": [
            (r.predicted_ttft_ms - r.predicted_queue_ms - r.predicted_load_ms)  # type: ignore[operator]
            - (r.engine_ttft_ms - r.engine_queue_ms - r.engine_load_ms)  # type: ignore[operator]
            for r in loaded
        ],
        "interference": [r.predicted_interference_ms - r.engine_interference_ms  # type: ignore[operator]
                         for r in imposing],
    }
    out: dict[str, Any] = {"audit_compared": len(timed), "audit_load_compared": len(tiered)}
    for term in AUDIT_TERMS:
        values = errors[term]
        out[f"audit_{term}_bias_ms"] = statistics.median(values) if values else math.nan
        out[f"audit_{term}_mae_ms"] = _mean([abs(v) for v in values])
    imposed = sum(r.engine_interference_ms for r in imposing)  # type: ignore[misc]
    predicted = sum(r.predicted_interference_ms for r in imposing)  # type: ignore[misc]
    out["audit_interference_total_ratio"] = predicted / imposed if imposed > 0 else math.nan
    engine_loads = sum(r.engine_load_ms for r in tiered)  # type: ignore[misc]
    out["audit_load_total_ratio"] = (sum(r.predicted_load_ms for r in tiered)  # type: ignore[misc]
                                     / engine_loads if engine_loads > 0 else math.nan)
    return out


def audit_lines(summaries: dict[str, dict[str, Any]], medians: bool = False) -> list[str]:
    """The prediction audit per kvgate run that priced its replicas (the cost policy): per term, bias and mean
    absolute error against the engine's clock, and the interference term's total against what was imposed."""
    lines: list[str] = []
    for name, summary in summaries.items():
        compared = summary.get("audit_compared")
        if _missing(compared) or not compared:
            continue
        parts = [_term_line(summary, term) for term in AUDIT_TERMS
                 if not _missing(summary.get(f"audit_{term}_bias_ms"))]
        if not summary.get("audit_load_compared"):
            parts.append("no loads from a cached tier")
        ratio = summary.get("audit_interference_total_ratio")
        if not _missing(ratio):
            parts.append(f"interference predicted in total {ratio:.2f}× what prefills imposed")
        lines.append(f"- {name} ({compared:,.0f} requests): " + "; ".join(parts))
    heading = ("Predicted TTFT against the engine's clock (predicted − engine), per term"
               + (" (median across repeats)" if medians else "") + ":")
    return ["", heading, ""] + lines if lines else []


def _term_line(summary: dict[str, Any], term: str) -> str:
    line = f"{term} bias {summary[f'audit_{term}_bias_ms']:+.1f} ms, |error| {summary[f'audit_{term}_mae_ms']:.1f}"
    if term != "load":
        return line
    ratio = summary.get("audit_load_total_ratio")
    total = "" if _missing(ratio) else f", in total {ratio:.2f}× the engines'"
    return f"{line} over {summary['audit_load_compared']:,.0f} requests with a load{total}"


LAG_WARNING_MS = 100.0


def schedule_warning(summary: dict[str, Any]) -> str | None:
    """A warning when the client did not send requests on schedule (its concurrency cap was full, or it was short of
    CPU): then the open-loop arrival process was not what the workload says, and latencies understate queueing."""
    lag = summary.get("send_lag_mean_ms")
    if _missing(lag) or lag <= LAG_WARNING_MS:
        return None
    return (f"requests were sent {lag:.0f} ms late on average (concurrency cap or client CPU): the offered load was "
            "lower than the workload's; raise --concurrency or lower the rate")


def compare(summaries: dict[str, dict[str, Any]], candidate: str = CANDIDATE) -> dict[str, dict[str, Any]]:
    """Per metric: the best baseline (best value among runs other than ``candidate``) and candidate/best.
    A ratio below 1 is better for lower-is-better metrics, above 1 for higher-is-better ones."""
    if candidate not in summaries:
        return {}
    baselines = {name: s for name, s in summaries.items() if name != candidate}
    out: dict[str, dict[str, Any]] = {}
    for m in METRICS:
        values = {name: s[m.key] for name, s in baselines.items() if not _missing(s.get(m.key))}
        mine = summaries[candidate].get(m.key)
        if not values or _missing(mine):
            continue
        pick = min if m.better == "lower" else max
        best = pick(values, key=values.__getitem__)
        ratio = mine / values[best] if values[best] else math.nan
        beats = mine < values[best] if m.better == "lower" else mine > values[best]
        out[m.key] = {"best_baseline": best, "baseline": values[best], "value": mine, "ratio": ratio, "better": beats}
    return out


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _median_of(values: Sequence[Any]) -> Any:
    """Median of the values present; nested dicts (requests per replica, gateway counters) key by key. A field that
    is not a number (or dict of numbers) keeps its first value; nothing present gives NaN (no data, as in one run)."""
    present = [v for v in values if not _missing(v)]
    if not present:
        return math.nan
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: _median_of([v[k] for v in present if k in v]) for k in keys}
    if all(_is_number(v) for v in present):
        return statistics.median(present)
    return present[0]


def median_summaries(repeats: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per run (in first-seen order), every field's median across the repeats that ran it. The median, not the mean:
    one repeat slowed by another process on this shared machine should not move the headline number."""
    names = list(dict.fromkeys(name for summaries in repeats for name in summaries))
    return {name: _median_of([s[name] for s in repeats if name in s]) for name in names}


def metric_ranges(repeats: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per run, each metric's (min, max) across repeats, over the repeats where it has a value."""
    names = list(dict.fromkeys(name for summaries in repeats for name in summaries))
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name in names:
        ranges: dict[str, tuple[float, float]] = {}
        for m in METRICS:
            values = [s[name].get(m.key) for s in repeats if name in s]
            present = [v for v in values if not _missing(v)]
            if present:
                ranges[m.key] = (min(present), max(present))
        out[name] = ranges
    return out


PAIRED_METRICS: tuple[str, ...] = (
    "engine_ttft_mean_ms", "engine_ttft_p99_ms", "ttft_mean_ms", "ttft_p99_ms", "engine_itl_p99_ms")
"""The metrics kvgate's claim is about: the cost policy beats every baseline on mean and p99 TTFT, on the engines'
clock and end to end, and (where prefill/decode disaggregation is in play) on the p99 of inter-token latency."""


@dataclass(frozen=True)
class PairedWins:
    """The candidate against one baseline on one metric, repeat by repeat: repeat k of each ran on the same workload
    at about the same time, so pairing cancels the machine's slow drift that medians alone would keep."""

    metric: Metric
    baseline: str
    candidate: str
    wins: int
    ties: int
    compared: int
    """Repeats where both have a value."""
    repeats: int
    ratios: tuple[float, ...]
    """candidate / baseline in each compared repeat (NaN where the baseline is 0)."""

    def sentence(self) -> str:
        """E.g. ``cost < prefix_affinity on engine TTFT mean in 5/5 repeats (ratios 0.88–0.97)``."""
        better = "<" if self.metric.better == "lower" else ">"
        head = f"{self.candidate} {better} {self.baseline} on {self.metric.label}"
        if not self.compared:
            return f"{head}: no repeat where both have a value"
        text = f"{head} in {self.wins}/{self.compared} repeats"
        finite = [r for r in self.ratios if not math.isnan(r)]
        if finite:
            text += f" (ratios {min(finite):.2f}–{max(finite):.2f})"
        if self.ties:
            text += f", {self.ties} tied"
        if self.compared < self.repeats:
            text += f"; {self.repeats - self.compared} of {self.repeats} repeats lack a value"
        return text

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric.key, "baseline": self.baseline, "candidate": self.candidate,
                "wins": self.wins, "ties": self.ties, "compared": self.compared, "repeats": self.repeats,
                "ratios": list(self.ratios), "text": self.sentence()}


def paired_wins(repeats: Sequence[dict[str, dict[str, Any]]], candidate: str = CANDIDATE,
                metrics: Sequence[str] = PAIRED_METRICS) -> list[PairedWins]:
    """For each baseline (every other run) and each of ``metrics``: in how many repeats the candidate was better by
    more than ``TIE_TOLERANCE`` (closer is a tie, not a win), and the per-repeat ratios. Empty when the candidate
    never ran."""
    if not any(candidate in s for s in repeats):
        return []
    by_key = {m.key: m for m in METRICS}
    baselines = [n for n in dict.fromkeys(n for s in repeats for n in s) if n != candidate]
    out: list[PairedWins] = []
    for baseline in baselines:
        for key in metrics:
            metric = by_key[key]
            wins = ties = 0
            ratios: list[float] = []
            for s in repeats:
                mine = s.get(candidate, {}).get(key)
                theirs = s.get(baseline, {}).get(key)
                if _missing(mine) or _missing(theirs):
                    continue
                ratios.append(mine / theirs if theirs else math.nan)
                if math.isclose(mine, theirs, rel_tol=TIE_TOLERANCE):
                    ties += 1
                elif (mine < theirs) == (metric.better == "lower"):
                    wins += 1
            out.append(PairedWins(metric, baseline, candidate, wins, ties, len(ratios), len(repeats), tuple(ratios)))
    return out


def _json_safe(v: Any) -> Any:
    """NaN (no data, e.g. no TTFT when every request failed) becomes null, so results.json is strict JSON."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def _fmt(v: Any) -> str:
    if _missing(v):
        return "n/a"
    if isinstance(v, int):
        return str(v)
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _label(m: Metric) -> str:
    return f"{m.label} ({m.unit})" if m.unit else m.label


Ranges = dict[str, dict[str, tuple[float, float]]]


def _cell(value: Any, spread: tuple[float, float] | None) -> str:
    """One table cell: the value, or with repeats ``median (min–max)``."""
    if spread is None or _missing(value):
        return _fmt(value)
    return f"{_fmt(value)} ({_fmt(spread[0])}–{_fmt(spread[1])})"


def _row_cells(m: Metric, summaries: dict[str, dict[str, Any]], ranges: Ranges | None) -> list[str]:
    return [_cell(s.get(m.key), ranges.get(name, {}).get(m.key) if ranges is not None else None)
            for name, s in summaries.items()]


def markdown_report(title: str, meta: dict[str, Any], summaries: dict[str, dict[str, Any]],
                    ratios: dict[str, dict[str, Any]], ranges: Ranges | None = None,
                    wins: Sequence[PairedWins] = (), candidate: str = CANDIDATE) -> str:
    """report.md. With ``ranges`` (several repeats) ``summaries`` are the medians and each cell shows
    ``median (min–max)``; ``wins`` adds the paired comparison per repeat."""
    names = list(summaries)
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    head = ["metric", *names] + ([f"{candidate} / best baseline"] if ratios else [])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        row = [_label(m), *_row_cells(m, summaries, ranges)]
        if ratios:
            r = ratios.get(m.key)
            row.append(f"{r['ratio']:.2f}× vs {r['best_baseline']}" if r and not _missing(r["ratio"]) else "n/a")
        lines.append("| " + " | ".join(row) + " |")
    lines += [""]
    if ranges is not None:
        lines += ["Each cell is the median (min–max) across repeats; ratios to the best baseline are of the medians."]
    lines += ["Ratios: below 1 is better for latency, imbalance and errors; above 1 for throughput and hit ratio.",
              "Hit ratio = cached / prompt tokens reported by the engines; oracle = an infinite cache shared by the"
              " whole fleet (block size 16). Oracle TTFT = an ideal router's: each request's tokens that cache lacks,"
              " prefilled on an idle engine with the sim's time model (no queueing). CPU = user + system seconds of the process group while the workload ran."]
    if wins:
        lines += ["", "## Wins per repeat", "",
                  f"{candidate} against each baseline in the same repeat (a tie is not a win):", ""]
        lines += [f"- {w.sentence()}" for w in wins]
    lines += audit_lines(summaries, medians=ranges is not None)
    lines += tail_lines(summaries, medians=ranges is not None)
    lines += copies_lines(summaries, medians=ranges is not None)
    lines += gateway_counter_lines(summaries, medians=ranges is not None)
    return "\n".join(lines) + "\n"


def gateway_counter_lines(summaries: dict[str, dict[str, Any]], medians: bool = False) -> list[str]:
    """What each kvgate did, from its /metrics at the end of the run: decisions by action/reason, hot-prefix
    replication events, warm-up tokens, transfers, upstream failures, waits past a deadline, requests routed on their
    prompt's beginning. Runs without counters (peer routers) are left out."""
    lines: list[str] = []
    for name, summary in summaries.items():
        counters = summary.get("gateway")
        if not counters:
            continue
        parts = []
        for group in ("decisions", "replication", "warmup_tokens", "transfers", "upstream_failures",
                      "upstream_waits_past_deadline", "routed_on_prompt_beginning"):
            values = {k: v for k, v in counters.get(group, {}).items() if v}
            if values:
                parts.append(f"{group} " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(values.items())))
        lines.append(f"- {name}: " + ("; ".join(parts) if parts else "no decisions counted"))
    heading = "Gateway counters at the end of each run" + (" (median across repeats)" if medians else "") + ":"
    return ["", heading, ""] + lines if lines else []


def print_table(title: str, summaries: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]],
                console: Console | None = None, ranges: Ranges | None = None,
                wins: Sequence[PairedWins] = (), candidate: str = CANDIDATE) -> None:
    """The terminal table; with ``ranges`` (several repeats) cells show ``median (min–max)``, then the wins per
    repeat, green when the candidate won every compared repeat."""
    console = console or Console()
    table = Table(title=title)
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right")
    if ratios:
        table.add_column(f"{candidate} / best baseline" + (" (medians)" if ranges is not None else ""),
                         justify="right")
    for m in METRICS:
        row = [_label(m), *_row_cells(m, summaries, ranges)]
        if ratios:
            r = ratios.get(m.key)
            if r and not _missing(r["ratio"]):
                colour = "green" if r["better"] else "red"
                row.append(f"[{colour}]{r['ratio']:.2f}×[/] vs {r['best_baseline']}")
            else:
                row.append("n/a")
        table.add_row(*row)
    console.print(table)
    if wins:
        console.print("[bold]wins per repeat[/] (same repeat, a tie is not a win):")
        for w in wins:
            colour = "green" if w.compared and w.wins == w.compared else "red"
            console.print(f"  [{colour}]{w.sentence()}[/]")
    for line in (audit_lines(summaries, medians=ranges is not None) + tail_lines(summaries, ranges is not None)
                 + copies_lines(summaries, ranges is not None)):
        console.print(line, markup=False)


def write_results(out_dir: Path, meta: dict[str, Any], runs: dict[str, Sequence[RequestRecord]],
                  summaries: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], title: str,
                  candidate: str = CANDIDATE) -> None:
    """results.json (everything, per request too) and report.md in ``out_dir``, for one repeat."""
    doc = {
        "meta": meta,
        "summaries": summaries,
        "ratios_to_best_baseline": ratios,
        "requests": {name: [r.to_json() for r in records] for name, records in runs.items()},
    }
    _write(out_dir, doc, markdown_report(title, meta, summaries, ratios, candidate=candidate))


@dataclass(frozen=True)
class Repeat:
    """One pass of a bench over every run (policies and peers), each on its own fresh fleet, in ``order``."""

    order: list[str]
    targets: dict[str, str]
    records: dict[str, list[RequestRecord]]
    summaries: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class RepeatedComparison:
    """Several repeats reduced for the reports: per-run medians (shaped like one run's summaries), their ranges,
    ratios of the medians to the best baseline, and the candidate's paired wins."""

    repeats: list[Repeat]
    summaries: dict[str, dict[str, Any]]
    ranges: Ranges
    ratios: dict[str, dict[str, Any]]
    wins: list[PairedWins]
    candidate: str = CANDIDATE

    @classmethod
    def of(cls, repeats: Sequence[Repeat], candidate: str = CANDIDATE) -> RepeatedComparison:
        per_repeat = [r.summaries for r in repeats]
        medians = median_summaries(per_repeat)
        return cls(list(repeats), medians, metric_ranges(per_repeat), compare(medians, candidate),
                   paired_wins(per_repeat, candidate), candidate)


def write_repeated_results(out_dir: Path, meta: dict[str, Any], comparison: RepeatedComparison, title: str) -> None:
    """results.json with every repeat (the layout in the module docstring) and report.md in ``out_dir``."""
    doc = {
        "meta": meta,
        "summaries": comparison.summaries,
        "ranges": comparison.ranges,
        "ratios_to_best_baseline": comparison.ratios,
        "wins_per_repeat": [w.to_json() for w in comparison.wins],
        "repeats": [
            {"repeat": k, "order": r.order, "targets": r.targets, "summaries": r.summaries,
             "ratios_to_best_baseline": compare(r.summaries, comparison.candidate),
             "requests": {name: [x.to_json() for x in records] for name, records in r.records.items()}}
            for k, r in enumerate(comparison.repeats, start=1)
        ],
    }
    report = markdown_report(title, meta, comparison.summaries, comparison.ratios, comparison.ranges, comparison.wins,
                             comparison.candidate)
    _write(out_dir, doc, report)


def _write(out_dir: Path, doc: dict[str, Any], report: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_json_safe(doc), indent=1, default=str, allow_nan=False))
    (out_dir / "report.md").write_text(report)
