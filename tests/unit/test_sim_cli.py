"""``kvgate sim`` arguments: defaults from SimParams, derived max_model_len, and clear refusals of bad values."""

from __future__ import annotations

import argparse

import pytest

from kvgate.loadgen.sim.cli import add_arguments, params_from_args, run
from kvgate.loadgen.sim.params import SimParams


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_sim_params() -> None:
    params = params_from_args(parse())
    defaults = SimParams(model="kvgate-sim")
    assert params.max_model_len == defaults.kv_blocks * defaults.block_size
    assert (params.prefill_ms_per_token, params.request_overhead_ms, params.time_scale) == (0.035, 20.0, 1.0)
    busy_decode_ms = params.step_overhead_ms + params.decode_ms_per_seq * 128
    assert 10 <= busy_decode_ms <= 30


def test_overrides() -> None:
    params = params_from_args(parse("--kv-blocks", "64", "--block-size", "32", "--time-scale", "0", "--topic", "kv"))
    assert (params.kv_blocks, params.block_size, params.max_model_len, params.time_scale, params.topic) == (
        64, 32, 2048, 0.0, "kv")
    with pytest.raises(ValueError, match="exceeds"):
        params_from_args(parse("--kv-blocks", "4", "--max-model-len", "100"))


@pytest.mark.parametrize(
    "argv", [("--replicas", "0"), ("--time-scale", "-1"), ("--kv-blocks", "0"), ("--token-budget", "0")]
)
def test_bad_values_are_refused(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(*argv)) == 2
    assert "kvgate sim:" in capsys.readouterr().err


def test_block_size_must_be_a_multiple_the_backend_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's CPU attention backend refuses --block-size 16 at startup: "No common block size for 16
    # (CPU_ATTN: [MultipleOf(32)])"; the sim can be told to behave the same.
    assert run(parse("--block-size", "16", "--block-size-multiple-of", "32")) == 2
    assert "No common block size for 16" in capsys.readouterr().err
    assert params_from_args(parse("--block-size", "64", "--block-size-multiple-of", "32")).block_size == 64
    assert params_from_args(parse("--block-size-multiple-of", "32")).block_size == 32
    assert params_from_args(parse()).block_size == 16


def test_roles_set_the_replica_count_and_must_agree_with_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.loadgen.sim.cli import replica_count

    args = parse("--roles", "prefill:2,decode:6")
    assert args.roles == ["prefill"] * 2 + ["decode"] * 6 and replica_count(args) == 8
    assert replica_count(parse()) == 4
    assert run(parse("--replicas", "4", "--roles", "prefill:1,decode:2")) == 2
    assert "--roles adds up to 3 replicas" in capsys.readouterr().err
    for bad in ("prefill", "prefill:0", "router:2", "prefill:2,decode:x"):
        with pytest.raises(SystemExit):
            parse("--roles", bad)
