"""Shared fixtures. Integration fixtures start real processes and stop them by PID in their finalizers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VECTORS = REPO / "tests" / "vectors"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    """The conformance vectors shipped with the repository; a missing one fails the tests that read it."""
    if not VECTORS.is_dir():
        pytest.fail(f"conformance vectors missing: {VECTORS}")
    return VECTORS
