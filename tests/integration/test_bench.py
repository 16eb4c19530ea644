"""A tiny real ``kvgate bench``: 2 replicas, 2 policies, 20 requests on a fast time scale — report, plots, ratios,
and every process it started is gone afterwards."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.router.settings.schema import load_config
from tests.support import REPO

pytestmark = pytest.mark.integration

def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_tiny_bench_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "kvgate.router.cli", "bench", "--workload", "shared-prefix", "--policies", "cost,round_robin",
        "--replicas", "2", "--kv-blocks", "512", "--time-scale", "0.01", "--groups", "2", "--prompts-per-group", "10",
        "--system-tokens", "640", "--question-tokens", "32", "--output-tokens", "8", "--rate", "40", "--seed", "1",
        "--ready-timeout", "30", "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    doc = json.loads((out / "results.json").read_text())
    assert set(doc["summaries"]) == {"cost", "round_robin"}
    for name, s in doc["summaries"].items():
        assert (s["requests"], s["ok"]) == (20, 20), (name, doc["requests"][name][:2])
        assert s["ttft_mean_ms"] > 0 and s["prompt_tokens"] > 0
        assert s["engine_ttft_mean_ms"] > 0  # model-clock TTFT collected from the sim for every request
        assert 0 < s["oracle_hit_ratio"] < 1
        assert sum(s["requests_per_replica"].values()) == 20 and len(s["requests_per_replica"]) == 2
        assert s["router_cpu_s"] > 0 and s["sim_cpu_s"] > 0  # CPU of each process group while the workload ran
        assert sum(s["gateway"]["decisions"].values()) == 20  # one routing decision per request, from /metrics
        assert s["prefill_tokens_computed"] > 0 and s["evicted_tokens"] >= 0  # the engines' cache totals
        assert s["oracle_ttft_mean_ms"] > 0 and s["engine_ttft_vs_oracle"] > 0
    assert doc["summaries"]["round_robin"]["load_imbalance"] >= 1.0
    assert doc["ratios_to_best_baseline"]["ttft_mean_ms"]["best_baseline"] == "round_robin"
    assert all(r["replica"] and r["engine_ttft_ms"] is not None for r in doc["requests"]["cost"])
    # The audit: the cost policy's predictions against the engine's clock, from kvgate's request log lines.
    cost = doc["summaries"]["cost"]
    assert cost["audit_compared"] == 20 and doc["summaries"]["round_robin"]["audit_compared"] == 0
    assert all(r["predicted_ttft_ms"] > 0 and r["engine_queue_ms"] is not None for r in doc["requests"]["cost"])
    assert all(r["predicted_interference_ms"] is not None and r["engine_interference_ms"] is not None
               and r["engine_load_ms"] is not None for r in doc["requests"]["cost"])
    assert cost["audit_prefill_mae_ms"] >= 0 and cost["audit_ttft_mae_ms"] >= 0
    # The copies audit: round robin sends each group's next question to the other replica, recomputing its
    # 640-token system prompt there, and later questions of the group reuse that copy.
    spread = doc["summaries"]["round_robin"]
    assert spread["copies"] >= 1 and spread["copy_tokens"] >= 512 and spread["copy_saved_tokens"] > 0
    assert cost["copies"] <= spread["copies"]
    report = (out / "report.md").read_text()
    assert "cost / best baseline" in report and "Predicted TTFT against the engine's clock" in report
    assert "Copies of held prefixes" in report
    assert {p.name for p in out.glob("*.png")} == {"ttft_cdf.png", "inflight_per_replica.png", "hit_ratio.png"}

    # Every gateway and fleet it started is stopped: none of their ports still answers.
    assert not any(_listening(url) for url in doc["meta"]["targets"].values())
    fleets = list((out / "logs").glob("*-fleet.yaml"))
    assert len(fleets) == 2
    for path in fleets:
        assert not any(_listening(r.url) for r in load_config(path).replicas)


@pytest.mark.parametrize("peer", ["sglang", "smg"])
def test_tiny_bench_with_a_cache_aware_peer(tmp_path: Path, peer: str) -> None:
    """The peer runs on its own identical fleet; the replica that served each request comes from the sim itself."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "kvgate.router.cli", "bench", "--workload", "unique", "--policies", "round_robin",
        "--peer", peer, "--replicas", "2", "--time-scale", "0.01", "--requests", "10", "--prompt-tokens", "64",
        "--output-tokens", "4", "--rate", "40", "--ready-timeout", "30", "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    summary = doc["summaries"][peer]
    failed = [(r["index"], r["status"], r["error"]) for r in doc["requests"][peer] if r["status"] != 200]
    router_log = (out / "logs" / f"{peer}-router.log").read_text(errors="replace")[-3000:]
    assert summary["ok"] == 10, f"the {peer} router failed {failed}; its log ends:\n{router_log}"
    assert sum(summary["requests_per_replica"].values()) == 10
    assert all(r["replica"] and r["engine_ttft_ms"] is not None for r in doc["requests"][peer])
    assert not any(_listening(url) for url in doc["meta"]["targets"].values())


def test_tiny_bench_with_vllm_routers_pd_mode_on_a_roles_fleet(tmp_path: Path) -> None:
    """vllm-router's P/D mode over the sim: every request's first leg on a prefill replica, its KV pulled by a
    decode replica; the engine view adds both legs' TTFT and has the decode leg's inter-token gaps."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "kvgate.router.cli", "bench", "--workload", "pd-mix", "--policies", "",
        "--peer", "vllm-router", "--replicas", "3", "--pd-roles", "prefill:1,decode:2", "--time-scale", "0.01",
        "--requests", "10", "--long-tokens", "300:600", "--long-output-tokens", "20:40", "--chat-tokens", "40:80",
        "--chat-output-tokens", "4:8", "--rate", "40", "--ready-timeout", "30", "--candidate", "vllm-router",
        "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    peer = doc["summaries"]["vllm-router"]
    assert peer["ok"] == 10 and peer["first_legs_served"] == 10 and peer["transfers_in"] == 10
    assert peer["off_role_requests"] == 0 and peer["engine_itl_p99_ms"] > 0 and peer["output_tok_s"] > 0
    records = doc["requests"]["vllm-router"]
    assert all(r["replica"] in ("sim-1", "sim-2") and r["engine_ttft_ms"] is not None for r in records)
    assert all(len(r["engine_itl_ms"]) == r["output_tokens"] - 1 for r in records)
    assert doc["meta"]["fleets"] == {"vllm-router": "prefill:1,decode:2"}
    assert not any(_listening(url) for url in doc["meta"]["targets"].values())


def test_tiny_bench_repeated(tmp_path: Path) -> None:
    """--repeat 2: each policy runs twice on fresh fleets, the second repeat in the rotated order, and the report
    keeps both repeats besides the medians, ranges and wins per repeat."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "kvgate.router.cli", "bench", "--workload", "unique", "--policies", "cost,round_robin",
        "--repeat", "2", "--replicas", "2", "--time-scale", "0.01", "--requests", "6", "--prompt-tokens", "64",
        "--output-tokens", "4", "--rate", "40", "--ready-timeout", "30", "--no-progress", "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "repeat 2/2: round_robin: starting a fresh fleet" in done.stdout

    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["repeats"] == 2
    assert [r["order"] for r in doc["repeats"]] == [["cost", "round_robin"], ["round_robin", "cost"]]
    for repeat in doc["repeats"]:
        assert {name: s["ok"] for name, s in repeat["summaries"].items()} == {"cost": 6, "round_robin": 6}
        assert all(len(records) == 6 for records in repeat["requests"].values())
        assert not any(_listening(url) for url in repeat["targets"].values())
    assert set(doc["ranges"]) == {"cost", "round_robin"}
    assert {(w["baseline"], w["compared"]) for w in doc["wins_per_repeat"]} == {("round_robin", 2)}
    assert "## Wins per repeat" in (out / "report.md").read_text()
    assert len(list((out / "logs").glob("*-fleet.yaml"))) == 4
