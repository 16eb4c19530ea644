"""Prefill/decode disaggregation on real processes: a sim fleet of two prefill and two decode replicas behind kvgate,
called with the official openai client. A long question about a document a prefill replica holds is prefilled there
(cache-aware: not on the other, cold, prefill replica) and decoded on a decode replica that pulls its KV; short and
decode-cached prompts stay local; a failed prefill leg falls back to a local prefill, a failed decode leg is retried
on the other decode replica. Every answer is one clean stream under the client's request id."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.integration.test_gateway import MODEL, gateway_config, metric_value, sim_fault, sim_requests
from tests.integration.test_gateway_transfer import document, explain, gpu_cached, index_of
from tests.support import Gateway, Sim, admin_replicas, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "pd-test-token"
PREFILL = ("sim-0", "sim-1")
DECODE = ("sim-2", "sim-3")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Gateway]]:
    workdir = tmp_path_factory.mktemp("disaggregation")
    sim = start_sim(workdir, 4, "--roles", "prefill:2,decode:2", "--time-scale", "1")  # PREFILL, then DECODE
    try:
        path = gateway_config(
            sim, workdir, "kvgate.yaml",
            server={"admin_token": ADMIN_TOKEN},
            policy={"name": "cost"},
            disaggregation={"mode": "cost"},
            # Health checks rarely, so a replica a test stops is still believed up when the next decision is made
            # (the failure tests need decisions made before the router can know).
            health={"interval_s": 60.0, "timeout_s": 1.0, "failures_to_down": 2, "successes_to_up": 1},
        )
        gw = start_kvgate(workdir, path)
    except Exception:
        sim.stop()
        raise
    yield sim, gw
    gw.stop()
    sim.stop()


@pytest.fixture(scope="module")
def always_gw(fleet: tuple[Sim, Gateway], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A second gateway over the same fleet that disaggregates every request (``disaggregation.mode: always``)."""
    workdir = tmp_path_factory.mktemp("disaggregation-always")
    config = yaml.safe_load(fleet[1].config_path.read_text())
    config["disaggregation"] = {"mode": "always"}
    path = workdir / "kvgate-always.yaml"
    path.write_text(yaml.safe_dump(config))
    gw = start_kvgate(workdir, path)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(fleet: tuple[Sim, Gateway]) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def records(sim: Sim, replica: str, request_id: str) -> list[dict]:
    return [r for r in sim_requests(sim, index_of(replica)) if r["headers"]["x-request-id"] == request_id]


def ask(client: openai.OpenAI, prompt: str, request_id: str) -> tuple[str, str]:
    """(replica, decision reason) of one streamed completion through kvgate, after checking the client saw one clean
    answer: the request id it sent, one completion id on every chunk, exactly ``MAX_TOKENS`` tokens of text (a
    prefill leg's token or a retried leg's would show as more) and no handshake field."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
    )
    chunks = list(raw.parse())
    assert raw.headers["x-request-id"] == request_id
    assert len({c.id for c in chunks}) == 1
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS and len(texts) == MAX_TOKENS
    assert not any("kv_transfer_params" in (c.model_extra or {}) for c in chunks)
    return raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-decision"]


def warm(sim: Sim, gw: Gateway, replica: str, doc: str, question: str) -> None:
    """``doc`` prefilled on ``replica`` straight from the sim (prefill replicas take no client requests), and
    known to kvgate from its BlockStored events."""
    httpx.post(
        sim.url(index_of(replica)) + "/v1/completions",
        json={"model": MODEL, "prompt": f"{doc}\nQuestion 0: which lemon?", "max_tokens": 1}, timeout=30,
    ).raise_for_status()
    wait_until(lambda: gpu_cached(gw, question)[replica] > 8000, f"{replica} to hold the document", timeout=10)


def disaggregated(gw: Gateway, result: str) -> float:
    return metric_value(gw, "kvgate_transfers_total", kind="disaggregated", result=result)


def test_a_long_question_is_prefilled_where_its_document_is_and_decoded_elsewhere(
    fleet: tuple[Sim, Gateway], client: openai.OpenAI
) -> None:
    sim, gw = fleet
    doc = document(11)
    question = f"{doc}\nQuestion 1: which harbor?"
    warm(sim, gw, "sim-1", doc, question)

    plan = explain(gw, question)
    assert (plan["decision"]["action"], plan["decision"]["source"]) == ("disaggregate", "sim-1")
    alternatives = plan["decision"]["disaggregation"]["alternatives"]
    assert {a["kind"] for a in alternatives} == {"local", "disaggregated"}
    assert {a["replica"] for a in alternatives if a["kind"] == "local"} == set(DECODE)
    assert {a.get("prefill_replica") for a in alternatives if a["kind"] == "disaggregated"} == set(PREFILL)
    assert {r["name"]: r["role"] for r in plan["replicas"]}["sim-1"] == "prefill"

    before = {result: disaggregated(gw, result) for result in ("started", "completed")}
    decided = metric_value(gw, "kvgate_decisions_total", action="disaggregate", reason="disaggregated")
    dest, reason = ask(client, question, "pd-long")
    assert reason == "disaggregated" and dest in DECODE
    (first_leg,) = records(sim, "sim-1", "pd-long")
    assert first_leg["completion_tokens"] == 1 and first_leg["kv_transfer_params_in"]["do_remote_decode"]
    assert not records(sim, "sim-0", "pd-long")  # the cold prefill replica was not chosen
    (pulled,) = records(sim, dest, "pd-long")
    assert pulled["transfer_status"] == "pulled" and pulled["transferred_tokens"] > 8000
    assert {result: disaggregated(gw, result) - before[result] for result in before} == {"started": 1, "completed": 1}
    assert metric_value(gw, "kvgate_transfer_bytes_total", kind="disaggregated") >= 8000 * 320 * 1024
    assert metric_value(gw, "kvgate_transfer_seconds_count", kind="disaggregated", result="completed") >= 1
    assert metric_value(gw, "kvgate_decisions_total", action="disaggregate", reason="disaggregated") == decided + 1
    # the prefill replica announced the question's blocks (BlockStored), the decode replica the pulled ones
    tokens = first_leg["prompt_tokens"]
    wait_until(lambda: gpu_cached(gw, question)["sim-1"] >= tokens - 16, "the prefill replica's BlockStored", 10)
    wait_until(lambda: gpu_cached(gw, question)[dest] >= tokens - 16, "the decode replica's BlockStored", 10)


def test_short_prompts_and_prompts_a_decode_replica_holds_stay_local(
    fleet: tuple[Sim, Gateway], client: openai.OpenAI
) -> None:
    sim, gw = fleet
    local = metric_value(gw, "kvgate_decisions_total", action="route", reason="local")
    replica, reason = ask(client, "Say hello in one short sentence.", "pd-short")
    assert reason == "local" and replica in DECODE
    assert not any(records(sim, p, "pd-short") for p in PREFILL)

    doc = document(12)
    question = f"{doc}\nQuestion 1: which canyon?"
    warm(sim, gw, "sim-3", doc, question)
    replica, reason = ask(client, question, "pd-cached")
    assert (replica, reason) == ("sim-3", "local")
    assert not any(records(sim, p, "pd-cached") for p in PREFILL)
    assert metric_value(gw, "kvgate_decisions_total", action="route", reason="local") == local + 2


def test_a_decode_leg_failing_before_its_first_byte_is_retried_on_the_other_decode_replica(
    fleet: tuple[Sim, Gateway], client: openai.OpenAI
) -> None:
    sim, gw = fleet
    doc = document(13)
    question = f"{doc}\nQuestion 1: which meadow?"
    warm(sim, gw, "sim-0", doc, question)
    plan = explain(gw, question)
    assert plan["decision"]["action"] == "disaggregate"
    target = plan["decision"]["replica"]
    (other,) = set(DECODE) - {target}
    failed = disaggregated(gw, "failed")
    sim_fault(sim, index_of(other), "stop", index_of(target))
    try:
        replica, reason = ask(client, question, "pd-decode-fails")
    finally:
        sim_fault(sim, index_of(other), "start", index_of(target))
    assert (replica, reason) == (other, "disaggregated")
    assert disaggregated(gw, "failed") == failed + 1
    (first_leg,) = records(sim, plan["decision"]["source"], "pd-decode-fails")
    assert first_leg["completion_tokens"] == 1
    # retried as a local prefill: the blocks the failed leg may have read are not read twice
    (served,) = records(sim, other, "pd-decode-fails")
    assert served["status"] == "completed" and served["kv_transfer_params_in"] is None
    assert served["transfer_status"] is None


def test_a_failed_prefill_leg_falls_back_to_a_local_prefill(
    fleet: tuple[Sim, Gateway], client: openai.OpenAI
) -> None:
    sim, gw = fleet
    doc = document(14)
    question = f"{doc}\nQuestion 1: which quartz?"
    warm(sim, gw, "sim-1", doc, question)
    assert explain(gw, question)["decision"]["source"] == "sim-1"
    fallbacks = disaggregated(gw, "fallback")
    sim_fault(sim, 2, "stop", 1)  # behind kvgate's back: it still believes the prefill replica is up
    try:
        replica, reason = ask(client, question, "pd-prefill-fails")
    finally:
        sim_fault(sim, 2, "start", 1)
    assert reason == "disaggregated" and replica in DECODE  # decided before kvgate could know
    assert disaggregated(gw, "fallback") == fallbacks + 1
    assert metric_value(gw, "kvgate_transfer_seconds_count", kind="disaggregated", result="fallback") >= 1
    (served,) = records(sim, replica, "pd-prefill-fails")
    assert served["status"] == "completed" and served["kv_transfer_params_in"] is None
    assert served["transferred_tokens"] == 0


def test_roles_are_shown_and_reloaded_in_place(fleet: tuple[Sim, Gateway]) -> None:
    sim, gw = fleet
    assert {name: r["role"] for name, r in admin_replicas(gw, ADMIN_TOKEN).items()} == {
        "sim-0": "prefill", "sim-1": "prefill", "sim-2": "decode", "sim-3": "decode",
    }
    original = gw.config_path.read_text()
    config = yaml.safe_load(original)
    config["replicas"][0]["role"] = "decode"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        gw.config_path.write_text(yaml.safe_dump(config))
        httpx.post(gw.url + "/admin/reload", headers=headers, timeout=10).raise_for_status()
        assert admin_replicas(gw, ADMIN_TOKEN)["sim-0"]["role"] == "decode"
        rows = {r["name"]: r["role"] for r in explain(gw, "hello")["replicas"]}
        assert rows == {"sim-0": "decode", "sim-1": "prefill", "sim-2": "decode", "sim-3": "decode"}
    finally:
        gw.config_path.write_text(original)
        httpx.post(gw.url + "/admin/reload", headers=headers, timeout=10).raise_for_status()
    assert admin_replicas(gw, ADMIN_TOKEN)["sim-0"]["role"] == "prefill"


def test_the_prefill_replica_holds_the_prompt_at_once_the_decode_replica_once_its_kv_exists(
    fleet: tuple[Sim, Gateway], always_gw: Gateway
) -> None:
    """A sibling routed while a disaggregated request's prefill leg runs sees the prompt predicted on the prefill
    replica, and not yet on the decode replica (which would recompute it: the KV it will pull does not exist yet)."""
    doc = document(15, words=6000)  # ~20,000 tokens: a prefill leg of ~700 ms on the sim's clock
    client = openai.OpenAI(base_url=always_gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = threading.Thread(target=ask, args=(client, f"{doc}\nQuestion 1: which ember?", "pd-sibling-1"))
    first.start()
    try:
        prefilling = wait_until(
            lambda: [name for name, r in admin_replicas(always_gw, ADMIN_TOKEN).items() if r["in_flight"]],
            "the prefill leg to be sent", timeout=10,
        )
        rows = {r["name"]: r["cached_tokens"] for r in explain(always_gw, f"{doc}\nQuestion 2: which orbit?")["replicas"]}
    finally:
        first.join(timeout=60)
    assert len(prefilling) == 1 and prefilling[0] in PREFILL
    assert rows[prefilling[0]]["predicted"] > 18_000
    assert all(rows[d]["predicted"] == 0 and rows[d]["gpu"] == 0 for d in DECODE), rows


def test_a_client_leaving_during_the_prefill_leg_aborts_it(fleet: tuple[Sim, Gateway], always_gw: Gateway) -> None:
    """Otherwise the prefill replica computes the prompt for nobody and holds its KV for a decode leg never sent."""
    sim, _ = fleet
    body = json.dumps({"model": MODEL, "prompt": document(16, words=6000) + "\nWhich river?", "max_tokens": 4})
    port = int(always_gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: pd-left\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        (prefill,) = wait_until(
            lambda: [name for name, r in admin_replicas(always_gw, ADMIN_TOKEN).items() if r["in_flight"]],
            "the prefill leg to be sent", timeout=10,
        )
    assert prefill in PREFILL

    def status() -> str | None:
        found = records(sim, prefill, "pd-left")
        return found[0]["status"] if found and found[0]["status"] != "running" else None

    assert wait_until(status, "the prefill leg to end", timeout=10) == "aborted"
    wait_until(lambda: metric_value(always_gw, "kvgate_client_disconnects_total") >= 1, "the disconnect counted")
    assert not any(records(sim, d, "pd-left") for d in DECODE)
    assert all(r["in_flight"] == 0 for r in admin_replicas(always_gw, ADMIN_TOKEN).values())
