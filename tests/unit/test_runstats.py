"""Bench's per-run accounting: CPU seconds of a process group from /proc, the gateway's counters from /metrics,
policy-file overrides, and how they show in report.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgate.loadgen.bench import SettingsError, apply_settings
from kvgate.loadgen.report import markdown_report
from kvgate.loadgen.runstats import CLOCK_TICKS, group_cpu_seconds, parse_gateway_counters
from kvgate.router.core.errors import ConfigError
from kvgate.router.settings.schema import load_config

METRICS_PAGE = """\
# HELP kvgate_decisions_total Routing decisions by action and reason.
# TYPE kvgate_decisions_total counter
kvgate_decisions_total{action="route",reason="warm"} 40.0
kvgate_decisions_total{action="route",reason="cold"} 8.0
kvgate_decisions_created{action="route",reason="warm"} 1.7e9
# HELP kvgate_transfers_total KV transfer handshakes by result (completed, fallback).
# TYPE kvgate_transfers_total counter
kvgate_transfers_total{result="completed"} 3.0
kvgate_transfers_total{result="failed"} 0.0
# HELP kvgate_warmup_tokens_total Prompt tokens prefilled by hot-prefix warm-ups.
# TYPE kvgate_warmup_tokens_total counter
kvgate_warmup_tokens_total 8192.0
# HELP kvgate_replication_started_total Hot-prefix warm-ups started, by reason.
# TYPE kvgate_replication_started_total counter
kvgate_replication_started_total{reason="hot-prefix"} 2.0
# HELP kvgate_replication_failed_total Warm-ups that failed, by reason.
# TYPE kvgate_replication_failed_total counter
kvgate_replication_failed_total{reason="timeout"} 0.0
# HELP kvgate_upstream_failures_total Upstream attempts that failed before any byte reached the client.
# TYPE kvgate_upstream_failures_total counter
kvgate_upstream_failures_total{replica="sim-0",cause="timeout"} 2.0
kvgate_upstream_failures_total{replica="sim-1",cause="timeout"} 1.0
kvgate_upstream_failures_total{replica="sim-1",cause="connect"} 4.0
# HELP kvgate_upstream_waits_past_deadline_total Upstream attempts answered after their first-byte deadline.
# TYPE kvgate_upstream_waits_past_deadline_total counter
kvgate_upstream_waits_past_deadline_total{replica="sim-0"} 5.0
# HELP kvgate_routed_on_prompt_beginning_total Requests routed on their prompt's beginning.
# TYPE kvgate_routed_on_prompt_beginning_total counter
kvgate_routed_on_prompt_beginning_total 6.0
"""


def _stat(pid: int, name: str, pgrp: int, utime: int, stime: int, cutime: int, cstime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    return f"{pid} ({name}) S 1 {pgrp} {pgrp} 0 -1 0 0 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0\n"


def test_group_cpu_sums_every_member_and_reaped_children(tmp_path: Path) -> None:
    for pid, name, pgrp, times in [
        (100, "kvgate sim", 100, (200, 100, 50, 50)),
        (101, "worker (x) y", 100, (100, 0, 0, 0)),  # spaces and parentheses in the command name
        (200, "other", 200, (9999, 0, 0, 0)),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, name, pgrp, *times))
    (tmp_path / "self").mkdir()
    assert group_cpu_seconds(100, tmp_path) == pytest.approx(500 / CLOCK_TICKS)
    assert group_cpu_seconds(300, tmp_path) is None


def test_group_cpu_of_this_process_group_is_real() -> None:
    assert (group_cpu_seconds(os.getpgrp()) or 0.0) > 0.0


def test_gateway_counters_are_read_by_label() -> None:
    counters = parse_gateway_counters(METRICS_PAGE)
    assert counters["decisions"] == {"route/warm": 40.0, "route/cold": 8.0}
    assert counters["transfers"] == {"completed": 3.0}
    assert counters["warmup_tokens"] == {"total": 8192.0}
    assert counters["replication"] == {"started/hot-prefix": 2.0}
    assert counters["upstream_failures"] == {"timeout": 3.0, "connect": 4.0}  # summed over replicas
    assert counters["upstream_waits_past_deadline"] == {"total": 5.0}
    assert counters["routed_on_prompt_beginning"] == {"total": 6.0}


def test_report_lists_each_gateways_counters() -> None:
    summaries = {"cost": {"gateway": parse_gateway_counters(METRICS_PAGE), "router_cpu_s": 1.5}, "sglang": {}}
    text = markdown_report("t", {}, summaries, {})
    assert "- cost: decisions route/cold 8, route/warm 40; replication started/hot-prefix 2;" in text
    assert "sglang:" not in text
    assert "| router CPU during run (s) | 1.5 | n/a |" in text


def test_settings_override_the_fleet_policy_file(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("replicas:\n  - {name: r0, url: 'http://127.0.0.1:1'}\n")
    apply_settings(config, ["replication.enabled=false", "replication.min_saving_ms_per_s=500"])
    loaded = load_config(config)
    assert loaded.replication.enabled is False and loaded.replication.min_saving_ms_per_s == 500
    assert [r.name for r in loaded.replicas] == ["r0"]
    with pytest.raises(SettingsError):
        apply_settings(config, ["replication.enabled"])
    apply_settings(config, ["replication.no_such_field=1"])  # written as asked; kvgate serve is the one to refuse it
    with pytest.raises(ConfigError, match="no_such_field"):
        load_config(config)
