"""Shared fixtures. Integration fixtures start real processes and stop them by PID in their finalizers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    d = SHARED / "vectors"
    if not d.exists():
        pytest.skip("../shared/vectors not present")
    return d
