import argparse
import json
from pathlib import Path

import yaml

import pytest

from kvgate.loadgen import bench
from kvgate.loadgen.bench import (
    HINTS_TOKEN, add_arguments, attach_predictions, describe_sim_speed, free_port_block, hint_configs, run_settings,
    run_spec,
)
from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.sim.params import SimParams
from kvgate.router.settings.schema import KvgateConfig


def test_baselines_run_without_replication_unless_told_otherwise() -> None:
    assert run_settings([], "cost") == []
    assert run_settings(["policy.cost.tie_margin=0"], "cost") == ["policy.cost.tie_margin=0"]
    assert run_settings([], "prefix_affinity") == ["replication.enabled=false"]
    assert run_settings(["scrape.interval_ms=50"], "round_robin") == ["replication.enabled=false", "scrape.interval_ms=50"]
    assert run_settings(["replication.enabled=true"], "least_loaded") == ["replication.enabled=true"]


def test_a_slowed_sim_is_described_to_the_router_at_its_wall_clock_speed(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    written = {"replicas": [{"name": "sim-0", "url": "http://127.0.0.1:1"}], "models": [{"name": "m", "block_size": 16}]}
    config.write_text(yaml.safe_dump(written))
    describe_sim_speed(config, 1.0)
    assert yaml.safe_load(config.read_text()) == written
    describe_sim_speed(config, 4.0)
    sim = SimParams(model="")
    prefill = yaml.safe_load(config.read_text())["models"][0]["prefill"]
    assert prefill == {"fixed_ms": sim.request_overhead_ms * 4, "per_token_ms": sim.prefill_ms_per_token * 4}
    transfer = yaml.safe_load(config.read_text())["transfer"]
    assert transfer == {"setup_ms": sim.transfer_setup_ms * 4, "bandwidth_gib_s": sim.transfer_gib_s / 4}
    policy = yaml.safe_load(config.read_text())["policy"]
    assert policy == {"tier_load_ms_per_token": {"cpu": sim.cpu_load_ms(1) * 4}}
    KvgateConfig.model_validate(yaml.safe_load(config.read_text()))


def test_gateways_with_hints_each_publish_and_hear_every_other(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump({"replicas": [{"name": "sim-0", "url": "http://127.0.0.1:1"}],
                                      "server": {"admin_token": "a"}}))
    labels = ["cost", "cost-gw2", "cost-gw3"]
    docs = [yaml.safe_load(p.read_text()) for p in hint_configs(config, tmp_path / "logs", labels)]
    binds = [d["peers"]["hints"]["bind"] for d in docs]
    assert len(set(binds)) == 3
    for d, bind in zip(docs, binds):
        assert sorted(d["peers"]["hints"]["connect"]) == sorted(b for b in binds if b != bind)
        assert d["server"] == {"admin_token": "a", "peer_token": HINTS_TOKEN}
        KvgateConfig.model_validate(d)


def test_pd_runs_use_the_cost_policy_on_the_roles_fleet_with_their_mode() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workload", "pd-mix", "--set", "scrape.interval_ms=50"])
    assert run_spec(args, "cost") == run_spec(args, "pd-cost").__class__("cost", None, ["scrape.interval_ms=50"])
    pd_cost, always, threshold = (run_spec(args, name) for name in ("pd-cost", "pd-always", "pd-threshold"))
    assert (pd_cost.policy, pd_cost.roles) == ("cost", "prefill:2,decode:6")
    assert pd_cost.settings == ["scrape.interval_ms=50", "disaggregation.mode=cost"]
    assert always.settings[-1] == "disaggregation.mode=always"
    assert threshold.settings[-2:] == ["disaggregation.mode=threshold", "disaggregation.threshold_tokens=16"]
    vllm_router = run_spec(args, "vllm-router")
    assert (vllm_router.policy, vllm_router.roles, vllm_router.settings) == (None, "prefill:2,decode:6", [])
    assert run_spec(args, "sglang").roles is None
    assert run_spec(args, "round_robin").settings == ["replication.enabled=false", "scrape.interval_ms=50"]


def test_predictions_are_held_to_the_model_clock_of_a_slowed_sim(tmp_path: Path) -> None:
    """The gateway prices a sim slowed down 4x at its wall-clock speed (above), so what it predicts is 4x the model
    clock the engines report: the audit divides it back, else every prediction reads as 4x too high."""
    log = tmp_path / "kvgate.log"
    log.write_text("\n".join([
        json.dumps({"logger": "kvgate.requests", "id": "loadgen-0", "predicted_ttft_ms": 400.0,
                    "predicted_queue_ms": 40.0, "ttft_ms": 600.0, "upstream_ttft_ms": 500.0}),
        "not json", json.dumps({"id": "unknown", "predicted_ttft_ms": 1.0, "predicted_queue_ms": 1.0}),
    ]) + "\n")
    record = RequestRecord(0, "chat", None, 0.0, 0.0, 0, 0)
    attach_predictions([record], [log], time_scale=4.0)
    assert (record.predicted_ttft_ms, record.predicted_queue_ms) == (100.0, 10.0)
    assert (record.gateway_ttft_ms, record.upstream_ttft_ms) == (600.0, 500.0)  # its own clock: the wall's


def test_a_port_block_is_never_handed_out_twice_before_its_server_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two blocks probed free one after the other (a sim's HTTP ports, then its ZMQ ports) must not overlap: neither
    is bound yet when the second is probed."""
    monkeypatch.setattr(bench, "_handed_out", {})
    starts = iter([20_000, 20_003, 20_010, 20_020, 20_030, 20_040])  # the second draw overlaps the first block
    monkeypatch.setattr(bench.random, "randrange", lambda *_: next(starts))
    first = free_port_block(4)
    second = free_port_block(4)
    assert set(range(first, first + 4)).isdisjoint(range(second, second + 4))
