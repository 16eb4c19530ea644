"""A short soak with faults (benchmarks/soak_faults.py, run as the script runs by hand): ``kvgate serve`` in front of
``kvgate sim`` with caches small enough to evict all the time (1,200 blocks: two or three of the longest documents), twelve clients on shared documents, a fault every few seconds
(restarts, health loss, dropped and delayed events, replay outages, cache resets, stalls). kvgate's credit on the
replica that served each request is compared with the engine's ``cached_tokens``: over-credited requests (a block or
more beyond what the engine reused, outside the requests that race a restart or reset) must stay at the bound the
index is built for. The five-minute run and its figures are in docs/index.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent.parent
SECONDS = 40
MAX_OVER_CREDITED_SHARE = 0.022
"""At most 2.2% of the compared requests: under this much eviction pressure the eviction cut leaves 0.4-1.6% and an
index that credits the blocks a full replica is about to evict 2.6-2.7% (docs/index.md has the side-by-side
figures); the bound sits between the two with room for a run's spread on each side."""


def test_a_short_soak_with_faults_barely_over_credits(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak_faults.py"), "--seconds", str(SECONDS), "--kv-blocks",
         "1200", "--fault-every", "4", "--seed", "7", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] <= summary["requests"] // 100, done.stdout
    assert summary["compared"] >= 150, done.stdout  # fewer on a loaded machine
    assert sum(summary["faults"].values()) >= 6, done.stdout
    allowed = max(2, int(summary["compared"] * MAX_OVER_CREDITED_SHARE))
    assert summary["over_credited"] <= allowed, json.dumps(summary["examples"][:5], indent=1) + done.stdout
