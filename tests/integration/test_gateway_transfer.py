"""A per-request KV transfer on real processes: a replica holding a long document is drained, and the next question
about the document is served by an idle replica that pulls the document's KV from it (vLLM's NixlConnector
handshake on the sim) instead of recomputing it. When the drained source dies before the first leg, the destination
recomputes and the client still gets its answer."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.test_gateway import MODEL, gateway_config, metric_value, sim_fault, sim_requests
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "transfer-test-token"
WORDS = (
    "river stone market engine winter garden signal copper harbor lantern orbit meadow thunder velvet canyon ember "
    "falcon glacier harvest island jungle kettle lemon marble nectar oyster pepper quartz rocket saddle timber"
).split()


def document(seed: int, words: int = 4000) -> str:
    """About 13,000 tokens of text: recomputing it costs ~480 ms of model time, pulling its KV ~210 ms."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Gateway]]:
    workdir = tmp_path_factory.mktemp("transfer")
    sim = start_sim(workdir, 3, "--time-scale", "1")
    try:
        config = gateway_config(
            sim, workdir, "kvgate.yaml",
            server={"admin_token": ADMIN_TOKEN},
            policy={"name": "cost"},
            # Health checks rarely, so a replica stopped by a test is still believed up when the next decision is
            # made (the fallback test needs a decision made before the router can know). Calibration collects
            # samples but never refits within these few requests (min_samples 32): the decisions stay on the
            # policy file's coefficients, which are the sim's.
            health={"interval_s": 60.0, "timeout_s": 1.0, "failures_to_down": 2, "successes_to_up": 1},
        )
        assert "nixl" in config.read_text()  # the sim's --write-config declares the connector
        gw = start_kvgate(workdir, config)
    except Exception:
        sim.stop()
        raise
    yield sim, gw
    gw.stop()
    sim.stop()


def index_of(replica: str) -> int:
    return int(replica.rsplit("-", 1)[1])


def record(sim: Sim, replica: int, request_id: str) -> dict:
    (found,) = [r for r in sim_requests(sim, replica) if r["headers"]["x-request-id"] == request_id]
    return found


def explain(gw: Gateway, prompt: str) -> dict:
    return httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=10).json()


def gpu_cached(gw: Gateway, prompt: str) -> dict[str, int]:
    return {r["name"]: r["cached_tokens"]["gpu"] for r in explain(gw, prompt)["replicas"]}


def drain(gw: Gateway, replica: str) -> None:
    resp = httpx.post(
        f"{gw.url}/admin/replicas/{replica}/drain", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5
    )
    assert resp.status_code == 200 and resp.json()["draining"] is True


def ask(client: openai.OpenAI, prompt: str, request_id: str) -> tuple[str, str, str]:
    """(replica, decision reason, text) of one streamed completion through kvgate (streams feed calibration)."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
    )
    text = "".join(chunk.choices[0].text for chunk in raw.parse() if chunk.choices)
    return raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-decision"], text


def calibration_samples(gw: Gateway) -> int:
    return explain(gw, "hello")["cost_model"]["calibration"]["samples"]


def direct_ttft_ms(sim: Sim, replica: int, prompt: str, request_id: str) -> float:
    """Model-clock TTFT of a request sent straight to one sim replica (no router)."""
    resp = httpx.post(
        sim.url(replica) + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
        headers={"X-Request-Id": request_id}, timeout=30,
    )
    resp.raise_for_status()
    return record(sim, replica, request_id)["ttft_ms"]


@pytest.fixture(scope="module")
def client(fleet: tuple[Sim, Gateway]) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_draining_holder_is_pulled_from_instead_of_recomputing(
    fleet: tuple[Sim, Gateway], client: openai.OpenAI
) -> None:
    sim, gw = fleet
    doc = document(1)
    source, _, _ = ask(client, f"{doc}\nQuestion 0: which river?", "warm-doc")
    doc_tokens = record(sim, index_of(source), "warm-doc")["prompt_tokens"] - 32  # the questions' blocks aside
    assert doc_tokens > 8000
    question = f"{doc}\nQuestion 1: which harbor?"
    wait_until(lambda: gpu_cached(gw, question)[source] >= doc_tokens, timeout=10)

    drain(gw, source)
    rows = {r["name"]: r for r in explain(gw, question)["replicas"]}
    assert {k: rows[source][k] for k in ("healthy", "draining", "can_source")} == {
        "healthy": False, "draining": True, "can_source": True,
    }
    assert rows[source]["cached_tokens"]["gpu"] >= doc_tokens  # drained, but its cache is still known
    samples = calibration_samples(gw)
    assert samples >= 1  # the warming request (a plain route) was one
    plan = explain(gw, question)
    assert (plan["decision"]["action"], plan["decision"]["source"]) == ("transfer", source)
    chosen = plan["decision"]["transfer"]
    recompute_ms = next(r for r in plan["replicas"] if r["name"] == chosen["dest"])["predicted_ttft_ms"]
    assert chosen["predicted_ttft_ms"] < recompute_ms / 1.5 and chosen["bytes"] >= doc_tokens * 320 * 1024

    dest, reason, text = ask(client, question, "ask-doc")
    assert reason == "transfer" and dest != source and text
    first_leg = record(sim, index_of(source), "ask-doc")
    assert first_leg["completion_tokens"] == 1 and first_leg["kv_transfer_params_in"]["do_remote_decode"]
    pulled = record(sim, index_of(dest), "ask-doc")
    assert pulled["transfer_status"] == "pulled" and pulled["transferred_tokens"] >= doc_tokens
    assert metric_value(gw, "kvgate_transfers_total", result="completed") >= 1
    # what the transfer moved and what it saved, for saved-prefill-per-byte
    assert metric_value(gw, "kvgate_transfer_bytes_total") >= doc_tokens * 320 * 1024
    assert metric_value(gw, "kvgate_transfer_prefill_avoided_seconds_total") > 0
    assert metric_value(gw, "kvgate_transfer_seconds_count", result="completed") >= 1
    assert metric_value(gw, "kvgate_transfers_total", result="started") >= metric_value(
        gw, "kvgate_transfers_total", result="completed"
    ) + metric_value(gw, "kvgate_transfers_total", result="fallback")
    # a pull is not a prefill: the calibrator did not take it as one (13,000 uncached tokens in ~220 ms)
    assert calibration_samples(gw) == samples
    # the destination announced the pulled blocks (BlockStored): the index now has it holding the document
    wait_until(lambda: gpu_cached(gw, question)[dest] >= doc_tokens, timeout=10)

    # the same question recomputed on the replica that holds nothing of the document, straight from the sim
    (cold,) = {f"sim-{i}" for i in range(sim.replicas)} - {source, dest}
    recompute_ttft = direct_ttft_ms(sim, index_of(cold), question, "recompute-doc")
    # model clock, the handshake's both legs included (~240 ms vs ~490 ms)
    handshake_ttft = first_leg["ttft_ms"] + pulled["ttft_ms"]
    assert handshake_ttft < recompute_ttft * 0.75, (first_leg["ttft_ms"], pulled["ttft_ms"], recompute_ttft)


def test_first_leg_failing_falls_back_to_recompute(fleet: tuple[Sim, Gateway], client: openai.OpenAI) -> None:
    sim, gw = fleet
    doc = document(2)
    # Warm a drained replica directly (it takes no traffic from kvgate), then stop it behind kvgate's back.
    drained = f"sim-{sim.replicas - 1}"
    drain(gw, drained)  # idempotent: the other test may have drained it already
    httpx.post(
        sim.url(index_of(drained)) + "/v1/completions",
        json={"model": MODEL, "prompt": f"{doc}\nQuestion 0: which lemon?", "max_tokens": 1}, timeout=30,
    ).raise_for_status()
    question = f"{doc}\nQuestion 1: which falcon?"
    wait_until(lambda: gpu_cached(gw, question)[drained] > 8000, timeout=10)
    fallbacks = metric_value(gw, "kvgate_transfers_total", result="fallback")
    other = next(i for i in range(sim.replicas) if i != index_of(drained))
    sim_fault(sim, other, "stop", index_of(drained))

    dest, reason, text = ask(client, question, "ask-doc-source-gone")
    assert reason == "transfer" and dest != drained and text  # decided before kvgate could know the source died
    assert metric_value(gw, "kvgate_transfers_total", result="fallback") == fallbacks + 1
    assert metric_value(gw, "kvgate_transfer_seconds_count", result="fallback") == fallbacks + 1
    served = record(sim, index_of(dest), "ask-doc-source-gone")
    assert served["status"] == "completed" and served["transfer_status"] is None and served["transferred_tokens"] == 0
