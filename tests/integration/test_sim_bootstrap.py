"""SGLang's prefill/decode handoff on a real sim process: the prefill leg and the decode leg of one room sent at
once (or the decode first), the decode pulling the room's KV at the link cost; a decode whose KV never comes failing
as SGLang's does after its bounded wait; and sglang-router's PD mode (the `kvgate bench --peer sglang-pd` command)
serving the official openai client over the sim."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import yaml

from kvgate.loadgen.bench import free_port_block, sglang_pd_command
from kvgate.loadgen.procs import ChildProcess
from kvgate.loadgen.sim.bootstrap import ROOM_MAX
from tests.support import Sim, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
WAIT_S = 1.0
"""The fleet's --transfer-lease-s: how long an offered room is held and a decode waits for its KV."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, int]]:
    workdir = tmp_path_factory.mktemp("bootstrap")
    bootstrap_port = free_port_block(3)
    sim = start_sim(workdir, 3, "--time-scale", "0.2", "--bootstrap-port", str(bootstrap_port),
                    "--transfer-lease-s", str(WAIT_S))
    yield sim, bootstrap_port
    sim.stop()


def document() -> str:
    """About 1,600 tokens nobody has sent before."""
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(["amber", "basalt", "cobalt", "delta", "ember", "fjord"]) for _ in range(500))


def fields(bootstrap_port: int, room: int | None = None) -> dict[str, Any]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randint(0, ROOM_MAX) if room is None else room}


def post(sim: Sim, replica: int, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(sim.url(replica) + "/v1/completions", json={"model": MODEL, **body}, timeout=20)


def stats(sim: Sim, replica: int) -> dict[str, Any]:
    return httpx.get(sim.url(replica) + "/sim/stats", timeout=5).json()


def record(sim: Sim, replica: int, room: int) -> dict[str, Any]:
    entries = httpx.get(sim.url(replica) + "/sim/requests", params={"limit": 50}, timeout=5).json()["requests"]
    return next(e for e in reversed(entries) if e.get("bootstrap_room") == room)


def test_write_config_lists_sglang_prefill_servers(fleet: tuple[Sim, int]) -> None:
    sim, bootstrap_port = fleet
    replicas = yaml.safe_load(sim.config_path.read_text())["replicas"]
    assert [(r["engine"], r["bootstrap_port"]) for r in replicas] == [("sglang", bootstrap_port + i) for i in range(3)]
    assert httpx.get(f"http://127.0.0.1:{bootstrap_port}/health", timeout=5).text == "OK"


@pytest.mark.parametrize("decode_first", [False, True])
def test_both_legs_of_a_room(fleet: tuple[Sim, int], decode_first: bool) -> None:
    sim, bootstrap_port = fleet
    body = {"prompt": document(), "max_tokens": 6, **fields(bootstrap_port)}
    room = body["bootstrap_room"]
    before_p, before_d = stats(sim, 0)["bootstrap"], stats(sim, 1)["bootstrap"]
    with ThreadPoolExecutor(2) as pool:
        if decode_first:
            decode = pool.submit(post, sim, 1, body)
            wait_until(lambda: stats(sim, 0)["bootstrap"]["rooms_waiting"] == 1, "the decode leg waiting on the room")
            prefill = pool.submit(post, sim, 0, body)
        else:
            prefill, decode = pool.submit(post, sim, 0, body), pool.submit(post, sim, 1, body)
        p, d = prefill.result(), decode.result()
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert p.json()["usage"]["completion_tokens"] == 1  # SGLang's prefill server answers the first token only
    assert d.json()["usage"]["completion_tokens"] == 6
    prefill_leg, decode_leg = record(sim, 0, room), record(sim, 1, room)
    assert (prefill_leg["bootstrap_leg"], decode_leg["bootstrap_leg"]) == ("prefill", "decode")
    assert decode_leg["transfer_status"] == "pulled" and decode_leg["transferred_tokens"] > 1000
    after_p, after_d = stats(sim, 0)["bootstrap"], stats(sim, 1)["bootstrap"]
    assert after_p["rooms_served"] == before_p["rooms_served"] + 1
    assert after_d["rooms_pulled"] == before_d["rooms_pulled"] + 1
    assert after_d["rooms_failed"] == before_d["rooms_failed"]


def test_a_decode_whose_kv_never_comes_fails_after_its_wait(fleet: tuple[Sim, int]) -> None:
    sim, bootstrap_port = fleet
    before = stats(sim, 2)["bootstrap"]["rooms_failed"]
    resp = post(sim, 2, {"prompt": document(), "max_tokens": 4, **fields(bootstrap_port)})
    assert resp.status_code == 500
    assert "KVTransferError" in resp.json()["error"]["message"]
    assert stats(sim, 2)["bootstrap"]["rooms_failed"] == before + 1


def test_a_decode_with_no_bootstrap_server_fails(fleet: tuple[Sim, int]) -> None:
    sim, _ = fleet
    resp = post(sim, 1, {"prompt": "hello", "max_tokens": 4, **fields(free_port_block(1))})
    assert resp.status_code == 500 and "bootstrap server did not answer" in resp.json()["error"]["message"]


def test_sglang_router_pd_mode_over_the_sim(fleet: tuple[Sim, int], tmp_path) -> None:
    sim, _ = fleet
    doc = yaml.safe_load(sim.config_path.read_text())
    for replica, role in zip(doc["replicas"], ["prefill", "decode", "decode"]):
        replica["role"] = role
    config = tmp_path / "roles.yaml"
    config.write_text(yaml.safe_dump(doc))
    port = free_port_block(1)
    router = ChildProcess("sglang router", sglang_pd_command(config, "127.0.0.1", port, ["--policy", "round_robin"]),
                          tmp_path / "router.log").start()
    try:
        router.wait_http(f"http://127.0.0.1:{port}/health", 30)
        served = stats(sim, 0)["bootstrap"]["rooms_served"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=5)
        prompt = document()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=5, stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len({c.id for c in chunks}) == 1
        direct = httpx.post(sim.url(2) + "/v1/chat/completions", timeout=20, json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 5}).json()
        assert text == direct["choices"][0]["message"]["content"]  # the decode's answer, once, not the prefill's
        assert stats(sim, 0)["bootstrap"]["rooms_served"] == served + 1
        pulled = sum(stats(sim, i)["bootstrap"]["rooms_pulled"] for i in (1, 2))
        assert pulled >= 1
    finally:
        router.stop()
