"""Failures are blamed correctly: requests whose content makes every engine fail (answered 500 everywhere) open no
breaker and never unready the gateway, while a replica that fails what the others serve is still ejected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.abuse.support import gateway_config
from tests.support import Gateway, Sim, admin_replicas, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN_TOKEN = "admin-token-for-tests"
TENANTS = {"api_keys": {"sk-alice": "alice", "sk-bob": "bob"}, "salt_secret": "breaker-blame-test-secret"}
ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}
POISON = "poisoned-content-7f3a"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    s = start_sim(tmp_path, 3, "--time-scale", "0")
    yield s
    s.stop()


@pytest.fixture
def gw(sim: Sim, tmp_path: Path) -> Iterator[Gateway]:
    config = gateway_config(sim, tmp_path, "k.yaml", tenants=TENANTS, server={"admin_token": ADMIN_TOKEN},
                            proxy={"backoff_base_ms": 0, "backoff_max_ms": 0})
    g = start_kvgate(tmp_path, config)
    wait_until(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, "the gateway ready")
    yield g
    g.stop()


def poison(sim: Sim, replica: int, marker: str | None) -> None:
    answer = httpx.post(sim.url(0) + "/sim/fault", json={"action": "poison", "marker": marker, "replica": replica},
                        timeout=5)
    assert answer.status_code == 200, answer.text


def complete(gw: Gateway, key: dict[str, str], text: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 2}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=key, timeout=10)


def breakers(gw: Gateway) -> dict[str, str]:
    return {name: r["breaker"] for name, r in admin_replicas(gw, ADMIN_TOKEN).items()}


def test_requests_that_fail_everywhere_open_no_breaker(gw: Gateway, sim: Sim) -> None:
    for replica in range(sim.replicas):
        poison(sim, replica, POISON)
    for i in range(30):  # each one tried on all three replicas, and 500 on each
        assert complete(gw, BOB, f"{POISON} {i}").status_code == 500
    assert set(breakers(gw).values()) == {"closed"}
    assert httpx.get(gw.url + "/ready", timeout=5).status_code == 200
    assert complete(gw, ALICE, "an ordinary request").status_code == 200


def test_a_replica_failing_what_the_others_serve_is_ejected(gw: Gateway, sim: Sim) -> None:
    poison(sim, 0, '"prompt"')  # replica 0 fails every completion; the others serve them
    for i in range(20):
        for key in (ALICE, BOB):
            assert complete(gw, key, f"request {i}").status_code == 200  # retried elsewhere
    assert breakers(gw)["sim-0"] != "closed"
    assert {state for name, state in breakers(gw).items() if name != "sim-0"} == {"closed"}
