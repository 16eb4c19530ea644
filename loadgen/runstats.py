"""What one bench run cost the machine and what the gateway did during it.

On a small shared machine, wall-clock latencies depend on who got the CPU: a router that burns more CPU slows the
simulated engines it shares cores with. Bench therefore reports each child's CPU seconds (its whole process group,
from ``/proc``) next to the latencies, and the gateway's own counters (decisions by reason, warm-ups, transfers)
scraped from its ``/metrics`` just before it stops, so a latency gap can be traced to work, not guessed at.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(stat: str) -> list[str]:
    """Fields of a ``/proc/<pid>/stat`` line after the command name (which may contain spaces and parentheses)."""
    return stat[stat.rindex(")") + 2 :].split()


def group_cpu_seconds(pgid: int, proc: Path = PROC) -> float | None:
    """User + system CPU seconds of every live process in process group ``pgid``, plus what their reaped children
    used (``cutime``/``cstime``). None when no such process is left (or there is no /proc)."""
    ticks = 0
    found = False
    try:
        entries = list(proc.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
        except (OSError, ValueError):
            continue  # the process exited between listing and reading
        # After the name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) cutime(13) cstime(14)
        if int(fields[2]) != pgid:
            continue
        found = True
        ticks += sum(int(f) for f in fields[11:15])
    return ticks / CLOCK_TICKS if found else None


COUNTERS = {
    "kvgate_decisions": ("action", "reason"),
    "kvgate_transfers": ("kind", "result"),
    "kvgate_upstream_failures": ("cause",),
    "kvgate_upstream_waits_past_deadline": (),
    "kvgate_routed_on_prompt_beginning": (),
}
"""Gateway counters copied into a run's summary, keyed by their joined label values (summed over the labels not
named; "total" when none is)."""


def parse_gateway_counters(text: str) -> dict[str, dict[str, float]]:
    """From a kvgate ``/metrics`` page: decisions by ``action/reason``, transfers by ``kind/result``, upstream failures
    by cause, waits past a first-byte deadline, requests routed on their prompt's beginning, replication events by
    ``event/reason``, and the warm-up tokens spent. Families that are absent come out empty, and labelled series
    still at zero (kvgate exports every known result and reason from the start) are left out."""
    out: dict[str, dict[str, float]] = {name.removeprefix("kvgate_"): {} for name in COUNTERS}
    out |= {"replication": {}, "warmup_tokens": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels and not sample.value:
                continue
            if family.name in COUNTERS and sample.name.endswith("_total"):
                labels = COUNTERS[family.name]
                key = "/".join(sample.labels[label] for label in labels if label in sample.labels) or "total"
                group = out[family.name.removeprefix("kvgate_")]
                group[key] = group.get(key, 0.0) + sample.value
            elif family.name == "kvgate_warmup_tokens" and sample.name.endswith("_total"):
                out["warmup_tokens"]["total"] = sample.value
            elif family.name.startswith("kvgate_replication_") and sample.name.endswith("_total"):
                event = family.name.removeprefix("kvgate_replication_")
                out["replication"][f"{event}/{sample.labels.get('reason', '')}"] = sample.value
    return out


def scrape_gateway_counters(url: str, timeout_s: float = 5.0) -> dict[str, dict[str, float]] | None:
    """:func:`parse_gateway_counters` of ``url``/metrics; None when the gateway does not answer (e.g. a peer
    router with no such page)."""
    try:
        resp = httpx.get(url + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_gateway_counters(resp.text)
    except ValueError:
        return None
