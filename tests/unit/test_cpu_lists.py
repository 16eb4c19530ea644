"""CPU lists for ``kvgate bench --gateway-cpus``: parsed as ``taskset -c`` writes them, and checked against the CPUs
this process may use."""

from __future__ import annotations

import argparse
import os

import pytest

from kvgate.loadgen.bench import _gateway_cpus
from kvgate.loadgen.procs import parse_cpu_list


@pytest.mark.parametrize(("text", "cpus"), [("1", {1}), ("0,2", {0, 2}), ("2-3", {2, 3}), ("0, 4-6", {0, 4, 5, 6})])
def test_cpu_lists_parse_as_taskset_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "1.5"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_the_gateway_cpus_must_be_this_process_s_and_leave_some_to_the_fleet() -> None:
    available = sorted(os.sched_getaffinity(0))
    with pytest.raises(argparse.ArgumentTypeError, match="not among"):
        _gateway_cpus(str(max(available) + 1))
    with pytest.raises(argparse.ArgumentTypeError, match="leaves no CPU"):
        _gateway_cpus(",".join(map(str, available)))
    if len(available) > 1:
        assert _gateway_cpus(str(available[-1])) == {available[-1]}
