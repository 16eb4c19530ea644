"""SGLang's P/D handoff through kvgate on real processes: `engine: sglang` replicas of both roles on the sim (its
bootstrap servers on), the official openai client as caller. A disaggregated request goes to the prefill and the
decode replica at once with one bootstrap room: the sim's counters show the room prefilled on the prefill replica and
pulled on the decode one, and the client's stream has the decode's text once under one request id. A prefill leg
that fails before the decode's first byte falls back to a local prefill on the decode replica; so does a decode leg
whose KV never comes (the decode server's 500)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml

from kvgate.loadgen.bench import free_port_block
from tests.integration.test_gateway import MODEL, metric_value, sim_fault, sim_requests
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

DECODE_WAIT_S = 2.0
"""How long the sim's decode legs wait for their room's KV (SGLang's waiting timeout, 300 s by default)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Gateway]]:
    workdir = tmp_path_factory.mktemp("sglang-pd")
    bootstrap_port = free_port_block(3)
    sim = start_sim(workdir, 3, "--roles", "prefill:1,decode:2", "--time-scale", "0.5",
                    "--bootstrap-port", str(bootstrap_port), "--transfer-lease-s", str(DECODE_WAIT_S))
    try:
        doc = yaml.safe_load(sim.config_path.read_text())
        # Only the prefill replica is an SGLang prefill server, with a bootstrap server; every replica is sglang.
        assert [(r["role"], r["engine"], r.get("bootstrap_port")) for r in doc["replicas"]] == [
            ("prefill", "sglang", bootstrap_port), ("decode", "sglang", None), ("decode", "sglang", None)]
        # Health checks rarely: a prefill replica stopped by a test is still believed up at the next decision.
        doc["health"] = {"interval_s": 60.0, "timeout_s": 1.0, "failures_to_down": 2, "successes_to_up": 1}
        doc["disaggregation"] = {"mode": "always"}
        config = workdir / "kvgate.yaml"
        config.write_text(yaml.safe_dump(doc))
        gw = start_kvgate(workdir, config)
    except Exception:
        sim.stop()
        raise
    yield sim, gw
    gw.stop()
    sim.stop()


def document() -> str:
    """About 2,000 tokens nobody has sent before."""
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(["amber", "basalt", "cobalt", "delta", "ember", "fjord"]) for _ in range(650))


def legs(sim: Sim, request_id: str) -> dict[str, list[dict[str, Any]]]:
    """Every record of ``request_id`` on every replica, by replica name."""
    return {f"sim-{i}": [r for r in sim_requests(sim, i) if r["headers"]["x-request-id"] == request_id]
            for i in range(3)}


def stream_chat(gw: Gateway, prompt: str, request_id: str) -> tuple[str, set[str], dict[str, str]]:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True,
        extra_headers={"X-Request-Id": request_id})
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, {c.id for c in chunks}, dict(raw.headers)


def direct_answer(sim: Sim, replica: int, prompt: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    return httpx.post(sim.url(replica) + "/v1/chat/completions", json=body, timeout=20).json()[
        "choices"][0]["message"]["content"]


def test_disaggregated_through_a_bootstrap_room(fleet: tuple[Sim, Gateway]) -> None:
    sim, gw = fleet
    prompt, request_id = document(), uuid.uuid4().hex
    served = httpx.get(sim.url(0) + "/sim/stats", timeout=5).json()["bootstrap"]["rooms_served"]
    text, ids, headers = stream_chat(gw, prompt, request_id)
    assert headers["x-kvgate-decision"] == "disaggregated"
    decode = headers["x-kvgate-replica"]
    assert decode in ("sim-1", "sim-2")
    seen = legs(sim, request_id)
    (prefill_leg,) = seen["sim-0"]
    (decode_leg,) = seen[decode]
    assert prefill_leg["bootstrap_leg"] == "prefill" and decode_leg["bootstrap_leg"] == "decode"
    assert prefill_leg["bootstrap_room"] == decode_leg["bootstrap_room"]
    assert prefill_leg["completion_tokens"] == 1 and prefill_leg["stream"] is False
    assert decode_leg["transfer_status"] == "pulled" and decode_leg["transferred_tokens"] > 1500
    assert httpx.get(sim.url(0) + "/sim/stats", timeout=5).json()["bootstrap"]["rooms_served"] == served + 1
    assert len(ids) == 1
    assert text == direct_answer(sim, int(decode[-1]), prompt)  # the decode's answer, once
    assert metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result="completed") >= 1


def test_a_failed_prefill_leg_falls_back_to_a_local_prefill(fleet: tuple[Sim, Gateway]) -> None:
    sim, gw = fleet
    fallbacks = metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result="fallback")
    sim_fault(sim, 1, "stop", 0)  # the prefill replica's HTTP server goes away; kvgate has not noticed yet
    try:
        prompt, request_id = document(), uuid.uuid4().hex
        text, ids, headers = stream_chat(gw, prompt, request_id)
    finally:
        sim_fault(sim, 1, "start", 0)
    decode = headers["x-kvgate-replica"]
    assert decode in ("sim-1", "sim-2")
    seen = legs(sim, request_id)
    assert seen["sim-0"] == []
    (local,) = seen[decode]
    assert local["bootstrap_leg"] is None and local["transfer_status"] is None
    assert local["completion_tokens"] == 8
    assert len(ids) == 1
    assert text == direct_answer(sim, int(decode[-1]), prompt)
    assert metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result="fallback") == fallbacks + 1


def test_a_decode_leg_whose_kv_never_comes_prefills_locally_there(fleet: tuple[Sim, Gateway]) -> None:
    sim, gw = fleet
    failed = metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result="failed")
    httpx.post(sim.url(1) + "/sim/fault", json={"action": "stall", "replica": 0, "seconds": 30}, timeout=5)
    try:  # the prefill replica takes the leg and computes nothing: the decode leg's wait runs out
        prompt, request_id = document(), uuid.uuid4().hex
        text, ids, headers = stream_chat(gw, prompt, request_id)
    finally:
        httpx.post(sim.url(1) + "/sim/fault", json={"action": "unstall", "replica": 0}, timeout=5)
    decode = headers["x-kvgate-replica"]
    assert decode in ("sim-1", "sim-2")
    seen = legs(sim, request_id)
    (failed_leg,) = [r for r in seen[decode] if r["status"] == "error"]  # its 500: KVTransferError
    assert "KVTransferError" in failed_leg["error"] and failed_leg["http_status"] == 500
    (local,) = [r for r in seen[decode] if r["status"] != "error"]
    assert local["bootstrap_leg"] is None and local["completion_tokens"] == 8
    assert [leg["status"] for leg in seen["sim-0"]] == ["aborted"]  # the prefill leg, cancelled
    assert len(ids) == 1
    assert text == direct_answer(sim, int(decode[-1]), prompt)
    assert metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result="failed") == failed + 1
