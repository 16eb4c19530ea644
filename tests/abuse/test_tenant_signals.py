"""Tenants see only their own: explain shows a tenant no figure that moves with another tenant's traffic, request ids
say nothing about anyone's traffic, and a tenant sees and uses only the models it is allowed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.abuse.support import assert_openai_error, gateway_config
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN = {"authorization": "Bearer admin-token-for-tests"}
ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}
CAROL = {"authorization": "Bearer sk-carol"}
TENANTS = {"api_keys": {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol"},
           "salt_secret": "tenant-signals-test-secret"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    # A small cache, so that one prompt's blocks move its free room visibly.
    s = start_sim(tmp_path_factory.mktemp("tenant-signals"), 1, "--time-scale", "0", "--kv-blocks", "1024")
    yield s
    s.stop()


def secured(sim: Sim, workdir: Path, **tenants: object) -> Gateway:
    return start_kvgate(workdir, gateway_config(sim, workdir, "k.yaml", tenants={**TENANTS, **tenants},
                                                server={"admin_token": "admin-token-for-tests"}))


@pytest.fixture(scope="module")
def gw(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = secured(sim, tmp_path_factory.mktemp("tenant-signals-gw"))
    yield g
    g.stop()


def explain(gw: Gateway, prompt: str, headers: dict[str, str]) -> dict:
    response = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt},
                          headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tenants_explain_does_not_move_with_another_tenants_traffic(gw: Gateway) -> None:
    """The finding: B's ``free_tokens`` dropped by 2,960 when A sent a new 2,971-token prompt, and by 0 when A
    repeated one. Now B's whole answer is the same before and after A's traffic."""
    probe = "bob's own question about the weather"
    before = explain(gw, probe, BOB)
    admin_before = explain(gw, probe, ADMIN)
    alice = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0, timeout=30)
    secret = " ".join(f"alice-{os.urandom(4).hex()}" for _ in range(400))  # a few thousand new tokens
    alice.completions.create(model=MODEL, prompt=secret, max_tokens=1)

    def admin_saw_it() -> bool:
        return explain(gw, probe, ADMIN)["replicas"][0]["free_tokens"] != admin_before["replicas"][0]["free_tokens"]

    wait_until(admin_saw_it, "alice's blocks in the index")  # the fleet's figures did move
    assert explain(gw, probe, BOB) == before
    row = before["replicas"][0]
    for hidden in ("free_tokens", "in_flight", "in_flight_prefill_tokens", "queue_delay_ms", "predicted_ttft_ms",
                   "arrival_rate_per_s"):
        assert hidden not in row
    assert "cost_model" not in before and "route_ms" not in before


def test_request_ids_reveal_nothing_about_other_tenants_traffic(gw: Gateway) -> None:
    def request_id(headers: dict[str, str]) -> str:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        return httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=10).headers["x-request-id"]

    first = request_id(BOB)
    for _ in range(5):
        request_id(ALICE)
    second = request_id(BOB)
    assert len(first) == len(second) == 32
    shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), 32)
    assert shared < 8  # a per-process prefix and a counter shared 20 characters and counted alice's requests


def test_a_tenant_sees_and_uses_only_its_models(sim: Sim, tmp_path: Path) -> None:
    gw = secured(sim, tmp_path, models={"carol": ["another-model-*"]})
    try:
        check_model_scoping(gw)
    finally:
        gw.stop()


def check_model_scoping(gw: Gateway) -> None:
    models = httpx.get(gw.url + "/v1/models", headers=CAROL, timeout=5).json()["data"]
    assert models == []
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    response = httpx.post(gw.url + "/v1/completions", json=body, headers=CAROL, timeout=10)
    assert_openai_error(response, 404, "model_not_found")  # the same answer as a model that does not exist
    response = httpx.post(gw.url + "/kvgate/v1/explain", json=body, headers=CAROL, timeout=10)
    assert_openai_error(response, 404, "model_not_found")
    alices = httpx.get(gw.url + "/v1/models", headers=ALICE, timeout=5).json()["data"]
    assert [m["id"] for m in alices] == [MODEL] and "root" not in alices[0]  # no filesystem path for tenants
    admins = httpx.get(gw.url + "/v1/models", headers=ADMIN, timeout=5).json()["data"]
    assert "root" in admins[0]
