"""Turn request records into the numbers a user compares: latency percentiles, throughput, hit ratio against the
oracle, load imbalance; then policies side by side with ratios to the best baseline, as results.json, report.md and
a terminal table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from loadgen.runner import RequestRecord

CANDIDATE = "cost"
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
    Metric("e2e_mean_ms", "E2E mean", "lower", "ms"),
    Metric("e2e_p50_ms", "E2E p50", "lower", "ms"),
    Metric("e2e_p90_ms", "E2E p90", "lower", "ms"),
    Metric("e2e_p99_ms", "E2E p99", "lower", "ms"),
    Metric("itl_mean_ms", "ITL mean", "lower", "ms"),
    Metric("throughput_rps", "throughput", "higher", "req/s"),
    Metric("output_tok_s", "output", "higher", "tok/s"),
    Metric("hit_ratio", "cache hit ratio", "higher"),
    Metric("oracle_hit_ratio", "oracle hit ratio", "higher"),
    Metric("load_imbalance", "load imbalance (max/mean)", "lower"),
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


def summarize(records: Sequence[RequestRecord], replicas: Sequence[str] | None = None) -> dict[str, Any]:
    """The headline numbers of one run. ``replicas`` names the whole fleet (so idle replicas count in the
    imbalance); by default, the replicas seen in responses."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s * 1000 for r in ok]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
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
        "send_lag_mean_ms": _mean([(r.start_s - r.arrival_s) * 1000 for r in records]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else math.nan,
        "oracle_hit_ratio": oracle / expected if expected else math.nan,
        "load_imbalance": load_imbalance(series) if routed else math.nan,
        "requests_per_replica": {rep: sum(1 for x, _, _ in routed if x == rep) for rep in fleet},
    }
    engine_ttft = [r.engine_ttft_ms for r in ok if r.engine_ttft_ms is not None]
    for name, values in (("ttft", ttft), ("e2e", e2e), ("engine_ttft", engine_ttft)):
        out[f"{name}_mean_ms"] = _mean(values)
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q)
    return out


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


def markdown_report(title: str, meta: dict[str, Any], summaries: dict[str, dict[str, Any]],
                    ratios: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    head = ["metric", *names] + ([f"{CANDIDATE} / best baseline"] if ratios else [])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        row = [_label(m), *(_fmt(summaries[n].get(m.key)) for n in names)]
        if ratios:
            r = ratios.get(m.key)
            row.append(f"{r['ratio']:.2f}× vs {r['best_baseline']}" if r and not _missing(r["ratio"]) else "n/a")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Ratios: below 1 is better for latency, imbalance and errors; above 1 for throughput and hit ratio.",
              "Hit ratio = cached / prompt tokens reported by the engines; oracle = an infinite cache shared by the"
              " whole fleet (block size 16). CPU = user + system seconds of the process group while the workload ran."]
    lines += gateway_counter_lines(summaries)
    return "\n".join(lines) + "\n"


def gateway_counter_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """What each kvgate did, from its /metrics at the end of the run: decisions by action/reason, hot-prefix
    replication events, warm-up tokens, transfers. Runs without counters (peer routers) are left out."""
    lines: list[str] = []
    for name, summary in summaries.items():
        counters = summary.get("gateway")
        if not counters:
            continue
        parts = []
        for group in ("decisions", "replication", "warmup_tokens", "transfers"):
            values = {k: v for k, v in counters.get(group, {}).items() if v}
            if values:
                parts.append(f"{group} " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(values.items())))
        lines.append(f"- {name}: " + ("; ".join(parts) if parts else "no decisions counted"))
    return ["", "Gateway counters at the end of each run:", ""] + lines if lines else []


def print_table(title: str, summaries: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]],
                console: Console | None = None) -> None:
    table = Table(title=title)
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right")
    if ratios:
        table.add_column(f"{CANDIDATE} / best baseline", justify="right")
    for m in METRICS:
        row = [_label(m), *(_fmt(s.get(m.key)) for s in summaries.values())]
        if ratios:
            r = ratios.get(m.key)
            if r and not _missing(r["ratio"]):
                colour = "green" if r["better"] else "red"
                row.append(f"[{colour}]{r['ratio']:.2f}×[/] vs {r['best_baseline']}")
            else:
                row.append("n/a")
        table.add_row(*row)
    (console or Console()).print(table)


def write_results(out_dir: Path, meta: dict[str, Any], runs: dict[str, Sequence[RequestRecord]],
                  summaries: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], title: str) -> None:
    """results.json (everything, per request too) and report.md in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": meta,
        "summaries": summaries,
        "ratios_to_best_baseline": ratios,
        "requests": {name: [r.to_json() for r in records] for name, records in runs.items()},
    }
    (out_dir / "results.json").write_text(json.dumps(_json_safe(doc), indent=1, default=str, allow_nan=False))
    (out_dir / "report.md").write_text(markdown_report(title, meta, summaries, ratios))
