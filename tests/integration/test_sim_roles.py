"""``kvgate sim --roles``: the policy file names each replica's role; a prefill replica serves vLLM's first leg
(``do_remote_decode``), a decode replica pulls its KV and streams the answer with engine-clock inter-token latency,
and a request off a replica's role is served but counted."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import yaml

from kvgate.loadgen.bench import BenchFleet, attach_engine_view
from kvgate.loadgen.runner import RequestRecord
from tests.support import Sim, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    s = start_sim(tmp_path, 3, "--roles", "prefill:1,decode:2")
    yield s
    s.stop()


def client(sim: Sim, replica: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url(replica) + "/v1", api_key="unused", timeout=10.0, max_retries=0)


def stats(sim: Sim, replica: int) -> dict[str, Any]:
    return httpx.get(sim.url(replica) + "/sim/stats", timeout=5).json()


def record(sim: Sim, replica: int, request_id: str) -> dict[str, Any]:
    entries = httpx.get(sim.url(replica) + "/sim/requests", timeout=5).json()["requests"]
    return next(e for e in entries if e["headers"]["x-request-id"] == request_id)


def test_roles_in_the_policy_file_and_a_first_leg_pulled_by_a_decode_replica(sim: Sim) -> None:
    config = yaml.safe_load(sim.config_path.read_text())
    assert [(r["name"], r["role"]) for r in config["replicas"]] == [
        ("sim-0", "prefill"), ("sim-1", "decode"), ("sim-2", "decode")]
    prompt = f"{uuid.uuid4()} " + " ".join(f"w{i} long shared context" for i in range(400))
    first_leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    prefill = client(sim, 0).completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"kv_transfer_params": first_leg},
        extra_headers={"X-Request-Id": "loadgen-0"})
    params = (prefill.model_extra or {})["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == stats(sim, 0)["engine_id"]
    stream = client(sim, 1).completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, extra_body={"kv_transfer_params": params},
        extra_headers={"X-Request-Id": "loadgen-0"})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text
    p, d = stats(sim, 0), stats(sim, 1)
    assert (p["role"], p["first_legs_served"], p["leases_pulled"], p["off_role_requests"]) == ("prefill", 1, 1, 0)
    assert (d["role"], d["transfers_in"], d["off_role_requests"]) == ("decode", 1, 0)
    pulled = record(sim, 1, "loadgen-0")
    assert pulled["transfer_status"] == "pulled" and pulled["transferred_tokens"] > 0
    assert len(pulled["itl_ms"]) == 11 and all(gap > 0 for gap in pulled["itl_ms"])
    assert d["itl"]["count"] == 11 and d["itl"]["mean_ms"] == pytest.approx(sum(pulled["itl_ms"]) / 11, abs=1e-3)
    # kvgate bench's engine view: the client waited for both legs; the gaps and the replica are the decode leg's.
    leg = record(sim, 0, "loadgen-0")
    seen = RequestRecord(0, "completions", None, 0.0, 0.0, 0, 0, status=200)
    attach_engine_view([seen], BenchFleet(sim.config_path, [sim.url(i) for i in range(3)],
                                     ["sim-0", "sim-1", "sim-2"], sim.process.proc.pid))
    assert seen.engine_ttft_ms == pytest.approx(leg["ttft_ms"] + pulled["ttft_ms"])
    assert seen.engine_itl_ms == pulled["itl_ms"] and seen.replica == "sim-1"


def test_requests_off_a_replicas_role_are_served_and_counted(sim: Sim) -> None:
    whole = client(sim, 0).completions.create(model=MODEL, prompt="sent straight to a prefill replica", max_tokens=3)
    assert whole.choices[0].text
    first_leg = client(sim, 2).completions.create(
        model=MODEL, prompt="a first leg sent to a decode replica", max_tokens=5,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    assert first_leg.usage is not None and first_leg.usage.completion_tokens == 1
    assert [stats(sim, i)["off_role_requests"] for i in range(3)] == [1, 0, 1]
    assert stats(sim, 2)["first_legs_served"] == 1
