"""The Grafana dashboard in deploy/grafana queries only what the gateway exports, with the labels it exports.

A panel that names a metric or a label the gateway does not export shows an empty graph in Grafana, not an error,
so a renamed metric would leave operators reading a flat line. These tests build the gateway's metrics registry
the way the app builds it, collect every name and label it registers, and check every query of the dashboard
against them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvgate.router.core.metrics import StatsCollector
from kvgate.router.gateway import Gateway
from kvgate.router.settings.holder import ConfigHolder
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvgate.json"

POLICY = "replicas: [{name: a, url: 'http://127.0.0.1:9'}]\n"
"""One replica, so the per-replica collectors have a replica to report."""

TARGET_LABELS = frozenset({"instance", "job"})
"""Labels Prometheus attaches to every series it scrapes from a gateway, whatever the gateway exports."""

SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
}
"""The series a family of each type is exposed as (Prometheus text format); other types are exposed as the name."""

RATE_TYPES = frozenset({"counter", "histogram"})
"""Families whose series only grow: a query reads them through rate() or increase(), never raw."""

AGGREGATIONS = ("sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile")
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                      "group_right", "inf", "nan"})

REQUIRED_ROWS = {
    "Requests and routing": {"kvgate_requests_total", "kvgate_decisions_total", "kvgate_retries_total",
                             "kvgate_upstream_failures_total", "kvgate_rejections_total"},
    "Cache": {"kvgate_matched_tokens_sum", "kvgate_cached_tokens_total", "kvgate_prompt_tokens_total",
              "kvgate_prefill_avoided_seconds_total"},
    "Latency": {"kvgate_ttft_seconds_bucket", "kvgate_e2e_seconds_bucket", "kvgate_route_seconds_bucket"},
    "Replicas": {"kvgate_in_flight", "kvgate_breaker_state", "kvgate_replica_healthy"},
    "Admission": {"kvgate_admission_waiting", "kvgate_admission_wait_seconds_bucket",
                  "kvgate_admission_refusals_total", "kvgate_admission_fairness"},
    "KV events and index": {"kvgate_events_applied_total", "kvgate_events_dropped_total",
                            "kvgate_events_gaps_detected_total", "kvgate_events_replays_requested_total",
                            "kvgate_events_resets_total", "kvgate_index_entries"},
    "Peers": {"kvgate_peer_hints_published_total", "kvgate_peer_hints_applied_total",
              "kvgate_peer_hints_dropped_total", "kvgate_unseen_request_rate", "kvgate_blind"},
    "Token parity and reloads": {"kvgate_parity_prompt_tokens_total", "kvgate_parity_cached_tokens_total",
                                 "kvgate_tokenizer_prompts_total", "kvgate_config_reloads_ok_total",
                                 "kvgate_config_reloads_rejected_total"},
}
"""What each row must show: the rows and signals the dashboard exists for, so none can quietly go missing."""


@dataclass
class Exported:
    """One series name the gateway exposes: the type of its family and every label it can carry."""

    type: str
    labels: set[str] = field(default_factory=set)


def declared_labels(obj: object) -> tuple[str, ...]:
    """The label names a metric was declared with. prometheus_client keeps them in ``_labelnames`` on its metric
    objects and metric families; neither ``collect()`` nor ``describe()`` reports them for a labelled metric that
    has no sample yet, which is every request-path metric of a gateway that has served nothing."""
    return tuple(getattr(obj, "_labelnames", ()))


def registered_collectors(registry: CollectorRegistry) -> list[Collector]:
    """Every collector registered on ``registry``. prometheus_client lists them nowhere public; its
    ``_collector_to_names`` map has one key per registered collector."""
    collectors = list(registry._collector_to_names)
    assert collectors, "the gateway's registry has no collectors: the test would check nothing"
    return collectors


def add(exported: dict[str, Exported], name: str, family_type: str, labels: set[str]) -> None:
    entry = exported.setdefault(name, Exported(family_type))
    entry.labels |= labels


def exported_series(registry: CollectorRegistry) -> dict[str, Exported]:
    """Every series name the registry exposes, with its family's type and labels.

    Names come from what each collector yields now (a family is yielded even with no samples) and, for the
    gateway's stats collectors, from the series they declare, since a stats field that is not there yet yields no
    family. A family's series names follow from its type, because a family with no samples exposes none.
    """
    exported: dict[str, Exported] = {}
    for collector in registered_collectors(registry):
        if isinstance(collector, StatsCollector):
            for series in collector.series:
                labels = {series.label} if series.label else set()
                for suffix in SAMPLE_SUFFIXES.get(series.kind, ("",)):
                    add(exported, series.name + suffix, series.kind, labels)
        wrapper_labels = set(declared_labels(collector)) if isinstance(collector, MetricWrapperBase) else set()
        for family in collector.collect():
            labels = wrapper_labels | set(declared_labels(family))
            for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)):
                extra = {"le"} if suffix == "_bucket" else set()
                add(exported, family.name + suffix, family.type, labels | extra)
            for sample in family.samples:
                add(exported, sample.name, family.type, labels | set(sample.labels))
    return exported


async def build_and_collect(policy: Path) -> dict[str, Exported]:
    gateway = Gateway(ConfigHolder(policy))
    gateway.build()
    try:
        return exported_series(gateway.metrics.registry)
    finally:
        await gateway.stop()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exported]:
    """What a gateway built in-process as the app builds it (``Gateway.build``) registers on its registry."""
    policy = tmp_path_factory.mktemp("dashboard") / "kvgate.yaml"
    policy.write_text(POLICY)
    series = asyncio.run(build_and_collect(policy))
    assert any(name.startswith("kvgate_") for name in series), "no kvgate_ series collected"
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those kept inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target."""
    for panel in panels_of(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target.get("expr", ""), target.get("legendFormat", "")


def blank_strings(expr: str) -> str:
    """The expression with every string literal emptied, so label values and Grafana variables in them are not
    read as names."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: every identifier outside selectors, ranges and grouping clauses
    that is neither a function or aggregation (followed by a parenthesis) nor a PromQL keyword."""
    text = blank_strings(expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names: set[str] = set()
    for match in re.finditer(r"(?<![\w$:.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = match.group()
        followed_by_call = re.match(r"\s*\(", text[match.end():]) is not None
        if not followed_by_call and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def selector_labels(expr: str) -> list[tuple[str, str]]:
    """(metric, label) for every label matcher in a ``metric{...}`` selector."""
    found: list[tuple[str, str]] = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", blank_strings(expr)):
        for label in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", match.group(2)):
            found.append((match.group(1), label))
    return found


def closing_paren(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def groupings(expr: str) -> list[tuple[list[str], str]]:
    """(by labels, argument) of every ``agg by (labels) (argument)`` aggregation."""
    text = blank_strings(expr)
    pattern = rf"\b(?:{'|'.join(AGGREGATIONS)})\s+by\s*\(([^)]*)\)\s*\("
    found: list[tuple[list[str], str]] = []
    for match in re.finditer(pattern, text):
        labels = [label.strip() for label in match.group(1).split(",") if label.strip()]
        open_at = match.end() - 1
        found.append((labels, text[open_at + 1:closing_paren(text, open_at)]))
    return found


def label_values(definition: str) -> tuple[str, str]:
    """(metric, label) of a ``label_values(metric, label)`` variable query."""
    match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", definition)
    assert match is not None, f"variable query is not label_values(metric, label): {definition}"
    return match.group(1), match.group(2)


def test_dashboard_is_an_importable_grafana_model(dashboard: dict[str, Any]) -> None:
    """Grafana 10/11 imports it as the ``kvgate`` dashboard and asks for a Prometheus data source, a model and a
    replica, so it works against any Prometheus without editing."""
    assert dashboard["uid"] == "kvgate"
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "replica"):
        assert variables[name]["type"] == "query"
        assert variables[name]["includeAll"] is True
        assert variables[name]["definition"].startswith("label_values(kvgate_")
    for panel in panels_of(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_every_panel_has_queries_and_a_description(dashboard: dict[str, Any]) -> None:
    """An operator reads the description to know what a panel shows and what to look for; a panel with no query
    shows nothing."""
    problems: list[str] = []
    for panel in panels_of(dashboard):
        title = panel.get("title", f"panel {panel.get('id')}")
        if not panel.get("description", "").strip():
            problems.append(f"{title}: no description")
        if panel["type"] == "row":
            continue
        targets = panel.get("targets", [])
        if not targets:
            problems.append(f"{title}: no targets")
        for target in targets:
            if not target.get("expr", "").strip():
                problems.append(f"{title}: target {target.get('refId')} has no expr")
    assert problems == [], "\n".join(problems)


def test_panels_have_unique_ids_and_do_not_overlap(dashboard: dict[str, Any]) -> None:
    """Stable, unique ids keep links to panels working; overlapping gridPos makes Grafana shuffle the layout."""
    panels = list(panels_of(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_queried_metric_is_exported(dashboard: dict[str, Any], exported: dict[str, Exported]) -> None:
    unknown: dict[str, set[str]] = {}
    for title, expr, _ in queries(dashboard):
        for name in metric_names(expr):
            if name not in exported:
                unknown.setdefault(name, set()).add(title)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            name, _ = label_values(variable["definition"])
            if name not in exported:
                unknown.setdefault(name, set()).add(f"variable {variable['name']}")
    assert unknown == {}, "metrics the gateway does not export:\n" + "\n".join(
        f"{name} (in {', '.join(sorted(titles))})" for name, titles in sorted(unknown.items()))


def test_every_label_used_is_one_the_metric_has(dashboard: dict[str, Any], exported: dict[str, Exported]) -> None:
    """Selectors, ``by (...)`` groupings, legends and variables name only labels the metrics carry (or the ones
    Prometheus adds on scrape)."""

    def has(name: str, label: str) -> bool:
        return label in TARGET_LABELS or (name in exported and label in exported[name].labels)

    problems: list[str] = []
    for title, expr, legend in queries(dashboard):
        text = blank_strings(expr)
        unchecked = re.findall(r"\b(without|on|ignoring|group_left|group_right)\s*\(", text)
        if unchecked or len(re.findall(r"\bby\s*\(", text)) != len(groupings(expr)):
            problems.append(f"{title}: write groupings as `agg by (...) (...)` so their labels can be checked: "
                            f"{expr}")
        for name, label in selector_labels(expr):
            if not has(name, label):
                problems.append(f"{title}: {name} has no label {label}")
        grouped: set[str] = set()
        for labels, argument in groupings(expr):
            grouped |= set(labels)
            for name in metric_names(argument):
                problems.extend(f"{title}: {name} has no label {label} (by)" for label in labels
                                if not has(name, label))
        aggregated = re.search(rf"\b(?:{'|'.join(AGGREGATIONS)})\s*(?:by\s*\([^)]*\)\s*)?\(", text) is not None
        available = grouped if aggregated else {label for name in metric_names(expr) if name in exported
                                                for label in exported[name].labels}
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
            if label not in available and label not in TARGET_LABELS:
                problems.append(f"{title}: legend {{{{{label}}}}} is not a label of the result of {expr}")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            name, label = label_values(variable["definition"])
            if not has(name, label):
                problems.append(f"variable {variable['name']}: {name} has no label {label}")
    assert problems == [], "\n".join(problems)


def test_counters_and_histograms_are_read_through_rate(dashboard: dict[str, Any],
                                                       exported: dict[str, Exported]) -> None:
    """A raw counter graphs a process's lifetime total, which resets with every restart; rate() is what an
    operator reads."""
    problems: list[str] = []
    for title, expr, _ in queries(dashboard):
        text = blank_strings(expr)
        for name in metric_names(expr):
            if name not in exported or exported[name].type not in RATE_TYPES:
                continue
            uses = len(re.findall(rf"(?<![\w:]){name}(?![\w:])", text))
            rated = len(re.findall(rf"\b(?:rate|irate|increase)\(\s*{name}\s*(?:\{{[^}}]*\}})?\s*\[[^\]]+\]\s*\)",
                                   text))
            if uses != rated:
                problems.append(f"{title}: {name} outside rate()/increase(): {expr}")
    assert problems == [], "\n".join(problems)


def test_every_row_has_panels_on_its_signals(dashboard: dict[str, Any]) -> None:
    """Each row the dashboard is for is there, with at least one panel, and queries the signals it exists for."""
    rows: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], [])
            current.extend(panel.get("panels", []))
        elif current is not None:
            current.append(panel)
    problems: list[str] = []
    for title, required in REQUIRED_ROWS.items():
        if not rows.get(title):
            problems.append(f"row {title!r}: missing or without panels")
            continue
        queried = {name for panel in rows[title] for target in panel.get("targets", [])
                   for name in metric_names(target.get("expr", ""))}
        if missing := required - queried:
            problems.append(f"row {title!r}: no panel queries {', '.join(sorted(missing))}")
    assert problems == [], "\n".join(problems)
