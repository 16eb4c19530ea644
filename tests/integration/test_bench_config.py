"""bench leaves the policy file's validation to ``kvgate serve``: a field serve refuses stops the run with serve's
own message, read from its exit code 2 and last line of output."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvgate.loadgen.bench import BenchFleet, apply_settings, gateway

pytestmark = pytest.mark.integration


def test_a_field_serve_refuses_stops_the_run_with_serves_message(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("replicas:\n  - {name: r0, url: 'http://127.0.0.1:1'}\n")
    apply_settings(config, ["replication.no_such_field=1"])
    args = argparse.Namespace(serve_args="", ready_timeout=30.0, gateway_cpus=None)
    fleet = BenchFleet(config, ["http://127.0.0.1:1"], ["r0"], os.getpid())
    with pytest.raises(RuntimeError, match=r"kvgate serve refused .*replication\.no_such_field"):
        with gateway(args, tmp_path, fleet, "cost", "bad"):
            pass
