"""The import graph matches the documented architecture (docs/design.md): the contracts in pyproject.toml's
``[tool.importlinter]``, checked by import-linter on every test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(lint_imports)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
