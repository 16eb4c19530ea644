"""``GET /admin/state`` against a running gateway: admin-only, bounded, counts and no prompt text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_gateway import MODEL, gateway_config
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "admin-s3cret-state"
MARKER = "zebra-quartz-marmalade"
"""A word the prompt carries and the dump must not."""
MAX_BODY_BYTES = 64 * 1024
"""Two replicas' state: far less than this (the dump's own caps bound it for any fleet:
tests/unit/test_admin_state.py)."""
SECTIONS = {"replicas_total", "replicas_truncated", "replicas", "index", "events", "peers", "blind", "admission"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("admin-state")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def gateway(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    gw = start_kvgate(workdir, gateway_config(sim, workdir, "state.yaml", server={"admin_token": ADMIN_TOKEN}))
    try:
        yield gw
    finally:
        gw.stop()


def test_only_the_admin_sees_the_state(gateway: Gateway) -> None:
    assert httpx.get(gateway.url + "/admin/state", timeout=5).status_code == 401
    wrong = httpx.get(gateway.url + "/admin/state", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 403 and "error" in wrong.json()


def test_without_an_admin_token_there_is_no_state(sim: Sim, workdir: Path) -> None:
    gw = start_kvgate(workdir, gateway_config(sim, workdir, "no-admin.yaml"))
    try:
        resp = httpx.get(gw.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
        assert resp.status_code == 404
    finally:
        gw.stop()


def test_the_state_counts_what_the_index_holds_and_shows_no_prompt(gateway: Gateway) -> None:
    prompt = f"{MARKER} " * 200
    resp = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                      timeout=10)
    assert resp.status_code == 200
    served = resp.headers["x-kvgate-replica"]
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def held() -> httpx.Response | None:
        state = httpx.get(gateway.url + "/admin/state", headers=headers, timeout=5)
        assert state.status_code == 200
        rows = {r["name"]: r for r in state.json()["replicas"]}
        return state if rows[served]["index"]["gpu_blocks"] > 0 else None

    state = wait_until(held, "the engine's KV events to reach the index", timeout=15)
    body = state.content
    assert len(body) < MAX_BODY_BYTES
    assert MARKER.encode() not in body
    doc = json.loads(body)
    assert SECTIONS <= doc.keys()
    assert doc["replicas_total"] == 2 and len(doc["replicas"]) == 2 and doc["replicas_truncated"] == 0
    row = next(r for r in doc["replicas"] if r["name"] == served)
    assert row["healthy"] and row["routable"] and row["breaker"] == "closed" and not row["draining"]
    assert row["scraped"] is not None and row["scraped"]["age_ms"] >= 0 and row["arrival_rate_per_s"] > 0
    assert row["cost_view"]["in_flight_prefilling"] == 0 and row["peers"]["prefilling"] == 0  # no peer reports
    events = row["events"]
    assert events["generation"] >= 0 and events["streams"][0]["last_seq"] >= 0
    assert events["counts"]["frames_applied"] > 0 and events["last_frame_age_s"] is not None
    assert doc["index"]["entries"] >= row["index"]["gpu_blocks"] and doc["events"]["events_applied"] > 0
    assert doc["blind"]["blind"] is False and doc["peers"]["reporting_total"] == 0 and doc["peers"]["heard"] == []
    assert doc["admission"]["waiting"] == 0

    def longest_list(value: object) -> int:
        """No list of numbers long enough to be token ids or block keys."""
        if isinstance(value, list):
            return max([len(value)] + [longest_list(v) for v in value])
        if isinstance(value, dict):
            return max([0] + [longest_list(v) for v in value.values()])
        return 0

    assert longest_list(doc) <= 8
