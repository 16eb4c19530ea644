"""Admission through a real kvgate in front of a real ``kvgate sim`` fleet whose prefill is slow (1 ms a token), so
that one long prompt keeps a replica from starting anything else for seconds: a request that finds no replica able
to start waits at the gateway, is routed when it is released (to a replica that became able while it waited, not
the one that was best when it arrived), leaves the queue the moment its client does, and is refused with 503 and
``Retry-After`` at its deadline; tenants over their limits get 429 with OpenAI's rate-limit headers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN = "admin-token-admission"
KEYS = {"sk-chat": "chat", "sk-limited": "limited"}
PER_TOKEN_MS = 1.0


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim-admission"), 2, "--time-scale", "1",
                  "--prefill-ms-per-token", str(PER_TOKEN_MS))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("gw-admission")
    config = yaml.safe_load(sim.config_path.read_text())
    config["models"][0]["prefill"] = {"fixed_ms": 20.0, "per_token_ms": PER_TOKEN_MS}
    config["calibration"] = {"enabled": False}
    config["replication"] = {"enabled": False}
    config["scrape"] = {"interval_ms": 50}
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config["server"] = {"admin_token": ADMIN}
    config["tenants"] = {"api_keys": KEYS, "salt_secret": "admission-test-salt-secret"}
    config["admission"] = {"max_start_delay_ms": 100, "deadline_s": 20, "band_deadlines_s": {9: 0.3},
                           "tenants": {"limited": {"requests_per_s": 1, "burst_s": 2, "max_concurrent": 5}}}
    path = workdir / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    g = start_kvgate(workdir, path)
    yield g
    g.stop()


def words(n: int) -> str:
    return f"{uuid.uuid4()} " + " ".join(f"w{i % 97}" for i in range(n))


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1, **extra}


def headers(key: str = "sk-chat", **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name and all(f'{k}="{v}"' in line for k, v in labels.items()))


def admin(gw: Gateway, path: str) -> None:
    httpx.post(gw.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).raise_for_status()


def waiting(gw: Gateway) -> float:
    return metric(gw, "kvgate_admission_waiting")


async def test_a_waiting_request_is_routed_where_capacity_appeared_while_it_waited(gw: Gateway) -> None:
    admin(gw, "/admin/replicas/sim-1/drain")
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            long = asyncio.create_task(client.post("/v1/chat/completions", json=body(words(3000)),
                                                   headers=headers()))
            await asyncio.to_thread(wait_until, lambda: metric(gw, "kvgate_in_flight", replica="sim-0") >= 1,
                                    "the long prompt on sim-0")
            short = asyncio.create_task(client.post("/v1/chat/completions", json=body(words(20)), headers=headers()))
            await asyncio.to_thread(wait_until, lambda: waiting(gw) == 1, "the short request waiting")
            explained = httpx.post(gw.url + "/kvgate/v1/explain", json=body("hi"),
                                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).json()["admission"]
            assert explained["saturated"] is True and explained["waiting_ahead"] == 1
            admin(gw, "/admin/replicas/sim-1/undrain")
            answer = await short
            assert answer.status_code == 200 and answer.headers["x-kvgate-replica"] == "sim-1"
            assert not long.done()  # it went on while sim-0 was still busy: decided at release, not at arrival
            assert (await long).status_code == 200
    finally:
        admin(gw, "/admin/replicas/sim-1/undrain")
    assert metric(gw, "kvgate_admission_wait_seconds_count", tenant="chat") >= 1


async def test_a_client_that_leaves_while_waiting_is_taken_out_and_a_deadline_gives_503(gw: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        busy = [asyncio.create_task(client.post("/v1/chat/completions", json=body(words(3000)), headers=headers()))
                for _ in range(2)]
        await asyncio.to_thread(wait_until, lambda: metric(gw, "kvgate_in_flight") >= 2, "both replicas busy")
        left_before = metric(gw, "kvgate_admission_refusals_total", reason="client_left")
        leaving = asyncio.create_task(client.post("/v1/chat/completions", json=body(words(20)), headers=headers()))
        await asyncio.to_thread(wait_until, lambda: waiting(gw) == 1, "the request waiting")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: waiting(gw) == 0, "the queue emptied by the client leaving")
        assert metric(gw, "kvgate_admission_refusals_total", reason="client_left") == left_before + 1

        late = await client.post("/v1/chat/completions", json=body(words(20), priority=9), headers=headers())
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "queue_deadline"
        for task in busy:
            assert (await task).status_code == 200


def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_rate_limit_headers(gw: Gateway) -> None:
    answers = [httpx.post(gw.url + "/v1/chat/completions", json=body("ping"), headers=headers("sk-limited"),
                          timeout=10) for _ in range(3)]
    assert [a.status_code for a in answers[:2]] == [200, 200]
    refused = answers[2]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_requests"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "60"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    other = httpx.post(gw.url + "/v1/chat/completions", json=body("ping"), headers=headers(), timeout=10)
    assert other.status_code == 200  # another tenant's limit is its own
    bad = httpx.post(gw.url + "/v1/chat/completions", json=body("ping"),
                     headers=headers(**{"X-Vllm-Priority": "urgent"}), timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-vllm-priority"
