"""The ``kvgate`` command: the sim, load generator and bench come from extras and say how to install them."""

from __future__ import annotations

import subprocess
import sys

import pytest


def kvgate_without(modules: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``kvgate ARGS`` in a fresh interpreter where ``modules`` cannot be imported, as in an installation that lacks
    them (a ``None`` in ``sys.modules`` makes their import fail)."""
    script = (f"import sys\nfor name in {modules!r}: sys.modules[name] = None\n"
              "from kvgate.router.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("command", "extra"), [("sim", "sim"), ("loadgen", "bench"), ("bench", "bench")])
def test_a_command_without_its_extra_says_how_to_install_it(command: str, extra: str) -> None:
    done = kvgate_without(["kvgate.loadgen"], command, "--help")
    assert done.returncode == 2
    assert f"pip install 'kvgate[{extra}]'" in done.stderr
    assert "kvgate.loadgen" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_gateway_runs_without_the_extras() -> None:
    done = kvgate_without(["kvgate.loadgen"], "serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--config" in done.stdout


def test_help_lists_every_command_and_loads_none() -> None:
    done = kvgate_without(["kvgate.loadgen", "kvgate.router.app.server", "kvgate.router.app.demo"], "--help")
    assert done.returncode == 0, done.stderr
    for command in ("serve", "demo", "sim", "loadgen", "bench"):
        assert command in done.stdout
