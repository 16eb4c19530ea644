"""The operator surface end to end: `kvgate sim` fleet + `kvgate serve` as real processes on loopback.

One sim of three replicas and one gateway (tenants on, admin token set, fast health checks) serve the whole module;
the policy file lists only replicas 0 and 1, so replica 2 is there for the admin API to add.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer admin-s3cret"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim"), 3, "--time-scale", "0")
    try:
        yield s
    finally:
        s.stop()


def policy_file(sim: Sim) -> str:
    data: dict[str, Any] = yaml.safe_load(sim.config_path.read_text())
    data["replicas"] = data["replicas"][:2]
    data["server"] = {**data.get("server", {}), "admin_token": "admin-s3cret"}
    data["tenants"] = {"api_keys": {"sk-alice": "alice", "sk-bob": "bob"}, "salt_secret": "operator-salt-secret"}
    data["health"] = {"interval_s": 0.1, "timeout_s": 0.5, "failures_to_down": 1, "successes_to_up": 1}
    data["policy"] = {**data.get("policy", {}), "name": "round_robin"}
    return yaml.safe_dump(data, sort_keys=False)


@pytest.fixture(scope="module")
def gateway(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    tmp = tmp_path_factory.mktemp("gw")
    config = tmp / "kvgate.yaml"
    text = policy_file(sim)
    config.write_text(text)
    gw = start_kvgate(tmp, config)
    try:
        yield gw, text
    finally:
        gw.stop()


def replicas(gw: Gateway) -> dict[str, dict[str, Any]]:
    resp = httpx.get(gw.url + "/admin/replicas", headers=ADMIN, timeout=5)
    assert resp.status_code == 200, resp.text
    return {r["name"]: r for r in resp.json()["data"]}


def complete(gw: Gateway, headers: dict[str, str], prompt: str = "hello operator", **extra: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/completions",
        headers={**headers, **extra},
        json={"model": "kvgate-sim", "prompt": prompt, "max_tokens": 4},
        timeout=10,
    )


def served_by(gw: Gateway, n: int) -> set[str]:
    names = set()
    for _ in range(n):
        resp = complete(gw, ALICE)
        assert resp.status_code == 200, resp.text
        names.add(resp.headers["x-kvgate-replica"])
    return names


def metric(gw: Gateway, name: str) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_auth_required_when_tenants_configured(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    for headers in ({}, {"Authorization": "Bearer sk-mallory"}):
        resp = complete(gw, headers)
        assert resp.status_code == 401
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert complete(gw, ALICE).status_code == 200


def test_tenants_get_different_cache_salts_upstream(sim: Sim, gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    prompt = "the same shared system prompt " * 8
    ids = {}
    for tenant, headers in (("alice", ALICE), ("bob", BOB), ("alice-again", ALICE)):
        resp = complete(gw, headers, prompt, **{"X-Request-Id": uuid.uuid4().hex})
        assert resp.status_code == 200
        ids[tenant] = resp.headers["x-request-id"]  # the id kvgate forwarded upstream
    salts: dict[str, str | None] = {}
    for i in range(sim.replicas):
        for rec in httpx.get(sim.url(i) + "/sim/requests", params={"limit": 1000}, timeout=5).json()["requests"]:
            for tenant, rid in ids.items():
                if rid in (rec["request_id"], rec["headers"].get("x-request-id")):
                    salts[tenant] = rec["cache_salt"]
    assert set(salts) == set(ids)
    assert salts["alice"] and salts["bob"] and salts["alice"] != salts["bob"]
    assert salts["alice"] == salts["alice-again"]


def test_bad_reload_keeps_old_config_and_is_counted(gateway: tuple[Gateway, str]) -> None:
    gw, good = gateway
    before = metric(gw, "kvgate_config_reloads_rejected_total")
    try:
        gw.config_path.write_text(good + "unknown_section: 1\n")
        resp = httpx.post(gw.url + "/admin/reload", headers=ADMIN, timeout=5)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "config_rejected"
        wait_until(lambda: metric(gw, "kvgate_config_reloads_rejected_total") >= before + 1, what="rejection counted")
        assert complete(gw, ALICE).status_code == 200  # old config (and its tenants) still in force
        assert complete(gw, {}).status_code == 401
    finally:
        gw.config_path.write_text(good)
    assert httpx.post(gw.url + "/admin/reload", headers=ADMIN, timeout=5).status_code == 200


def test_admin_needs_token(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    assert httpx.get(gw.url + "/admin/replicas", timeout=5).status_code == 401
    assert httpx.get(gw.url + "/admin/replicas", headers=ALICE, timeout=5).status_code == 403


def test_admin_add_drain_remove(sim: Sim, gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    name = "added-by-admin"
    resp = httpx.post(gw.url + "/admin/replicas", headers=ADMIN, json={"name": name, "url": sim.url(2)}, timeout=5)
    assert resp.status_code == 201, resp.text
    try:
        wait_until(lambda: replicas(gw)[name]["routable"], what="added replica healthy")
        wait_until(lambda: name in served_by(gw, 3), what="added replica serving")
        resp = httpx.post(gw.url + f"/admin/replicas/{name}/drain", headers=ADMIN, timeout=5)
        assert resp.status_code == 200 and resp.json()["draining"] is True
        assert name not in served_by(gw, 6)
    finally:
        resp = httpx.delete(gw.url + f"/admin/replicas/{name}", headers=ADMIN, timeout=5)
    assert resp.status_code == 200
    assert name not in replicas(gw)


def test_unhealthy_replica_is_skipped_and_comes_back(sim: Sim, gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    sick, state = next(iter(replicas(gw).items()))
    index = [sim.url(i) for i in range(sim.replicas)].index(state["url"])
    generation = state["generation"]
    httpx.post(sim.url(index) + "/sim/fault", json={"action": "unhealthy"}, timeout=5).raise_for_status()
    try:
        wait_until(lambda: not replicas(gw)[sick]["healthy"], what="replica marked down")
        assert sick not in served_by(gw, 6)
    finally:
        httpx.post(sim.url(index) + "/sim/fault", json={"action": "healthy"}, timeout=5).raise_for_status()
    wait_until(lambda: replicas(gw)[sick]["routable"], what="replica back")
    assert replicas(gw)[sick]["generation"] == generation + 1
    wait_until(lambda: sick in served_by(gw, 2), what="replica serving again")


def test_scraped_engine_load_is_visible(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    # A scrape taken while an earlier test's request was running may still show it; the idle fleet must read as
    # idle by a later scrape.
    wait_until(
        lambda: all(
            r["scraped"] is not None and r["scraped"]["waiting"] == 0 and r["scraped"]["running"] == 0
            for r in replicas(gw).values()
        ),
        what="scrapes of an idle fleet",
    )
    for r in replicas(gw).values():
        assert r["scraped"]["block_size"] is not None and r["models"] == ["kvgate-sim"]


def test_reloaded_file_adds_and_removes_replicas_and_sighup_does_not_kill(sim: Sim, gateway: tuple[Gateway, str]) -> None:
    gw, good = gateway
    ok_before = metric(gw, "kvgate_config_reloads_ok_total")
    data = yaml.safe_load(good)
    data["replicas"].append({"name": "from-file", "url": sim.url(2)})
    try:
        gw.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        gw.process.signal(signal.SIGHUP)
        wait_until(lambda: "from-file" in replicas(gw), what="replica from the reloaded file")
        assert metric(gw, "kvgate_config_reloads_ok_total") >= ok_before + 1
        assert gw.process.alive()
    finally:
        gw.config_path.write_text(good)
        gw.process.signal(signal.SIGHUP)
    wait_until(lambda: "from-file" not in replicas(gw), what="replica gone with the restored file")
