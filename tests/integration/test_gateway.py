"""`kvgate serve` end to end: a real `kvgate sim` fleet, kvgate as a subprocess, the official openai client as caller."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvgate.cache_index.ingest import DROP_REASONS
from kvgate.loadgen.procs import ChildProcess
from kvgate.loadgen.sim.wire import BlockStored, KVEventBatch
from tests.support import KVGATE, REPO, Gateway, Sim, free_port_block, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"


def gateway_config(sim: Sim, directory: Path, name: str, **sections: dict) -> Path:
    """The sim's policy file with faster health checks (and any section overrides) for tests."""
    config = yaml.safe_load(sim.config_path.read_text())
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config.update(sections)
    path = directory / name
    path.write_text(yaml.safe_dump(config))
    return path


def sim_fault(sim: Sim, via: int, action: str, replica: int) -> None:
    httpx.post(sim.url(via) + "/sim/fault", json={"action": action, "replica": replica}, timeout=5).raise_for_status()


def sim_requests(sim: Sim, i: int) -> list[dict]:
    return httpx.get(sim.url(i) + "/sim/requests?limit=1000", timeout=5).json()["requests"]


def metric_value(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 3, "--time-scale", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    config = gateway_config(sim, workdir, "kvgate.yaml", server={"max_body_bytes": 200_000})
    g = start_kvgate(workdir, config)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def rr_gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    """Round robin with the breaker slow to open, so a stopped replica keeps being tried first and retried."""
    config = gateway_config(sim, workdir, "kvgate-rr.yaml", breaker={"failures_to_open": 100})
    g = start_kvgate(workdir, config, "--policy", "round_robin")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_chat_non_streaming_through_kvgate(client: openai.OpenAI, sim: Sim) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello gateway"}], max_tokens=5,
        extra_headers={"X-Request-Id": "req-nonstream-1", "X-Session-ID": "sess-1"},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    replica = raw.headers["x-kvgate-replica"]
    assert replica.startswith("sim-")
    assert raw.headers["x-kvgate-decision"]
    assert raw.headers["x-request-id"] == "req-nonstream-1"
    seen = [r for r in sim_requests(sim, int(replica.split("-")[1])) if r["headers"]["x-request-id"] == "req-nonstream-1"]
    assert seen and seen[0]["headers"]["x-session-id"] == "sess-1"


def request_log_lines(gw: Gateway, request_id: str) -> list[dict]:
    lines = [json.loads(line) for line in gw.process.output().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("logger") == "kvgate.requests" and line.get("id") == request_id]


def test_each_request_writes_one_json_log_line(client: openai.OpenAI, gw: Gateway) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "log me " * 40}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "req-logged-1"},
    )
    usage = list(raw.parse())[-1].usage
    assert usage is not None
    (line,) = wait_until(lambda: request_log_lines(gw, "req-logged-1"), timeout=5.0)
    assert line["level"] == "info" and line["status"] == "200" and line["stream"] is True
    assert line["replica"] == raw.headers["x-kvgate-replica"] and line["decision"] == raw.headers["x-kvgate-decision"]
    assert line["prompt_tokens"] == usage.prompt_tokens and line["cached_tokens"] == (
        usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    )
    assert line["ttft_ms"] > 0 and line["e2e_ms"] >= line["ttft_ms"] and line["attempts"] == 1
    assert 0 < line["upstream_ttft_ms"] <= line["ttft_ms"]  # the part after dispatch


@pytest.mark.parametrize("paragraphs", [700, 1500])  # a body tokenized on the loop, and one parsed on a worker
def test_a_long_new_prompt_is_routed_before_all_of_it_is_tokenized(
    client: openai.OpenAI, gw: Gateway, paragraphs: int
) -> None:
    """A long prompt new to the gateway is routed on its beginning while its rest is tokenized; what the request
    leaves behind is still the whole prompt's: its log line's count and the parity check equal the engine's."""
    routed_early = metric_value(gw, "kvgate_routed_on_prompt_beginning_total")
    matched = metric_value(gw, "kvgate_parity_prompt_tokens_total", api="completions", result="match")
    mismatched = metric_value(gw, "kvgate_parity_prompt_tokens_total", result="mismatch")
    document = " ".join(f"fresh paragraph {i} on topic {i * 7 % 13} of {paragraphs}." for i in range(paragraphs))
    request_id = f"req-routed-early-{paragraphs}"
    stream = client.completions.create(
        model=MODEL, prompt=document, max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    (line,) = wait_until(lambda: request_log_lines(gw, request_id), timeout=5.0)
    assert line["prompt_tokens"] == usage.prompt_tokens > 4000
    assert metric_value(gw, "kvgate_routed_on_prompt_beginning_total") == routed_early + 1
    assert metric_value(gw, "kvgate_parity_prompt_tokens_total", api="completions", result="match") == matched + 1
    assert metric_value(gw, "kvgate_parity_prompt_tokens_total", result="mismatch") == mismatched


def test_every_proxied_endpoint_writes_exactly_one_request_log_line(gw: Gateway) -> None:
    """Answered, relayed engine errors and refusals alike, on every proxied path: one line each, no more."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "one line"}], "max_tokens": 2}
    sent = {
        "log-chat": ("/v1/chat/completions", json.dumps(chat)),
        "log-chat-stream": ("/v1/chat/completions", json.dumps({**chat, "stream": True})),
        "log-completion": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "one line", "max_tokens": 2})),
        "log-embedding": ("/v1/embeddings", json.dumps({"model": MODEL, "input": "one line"})),
        "log-embedding-unknown-model": ("/v1/embeddings", json.dumps({"model": "nope", "input": "one line"})),
        "log-chat-bad-json": ("/v1/chat/completions", "{not json"),
        "log-completion-steering": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "kv_transfer_params": {}})),
    }
    statuses = {}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for request_id, (path, body) in sent.items():
            answer = http.post(path, content=body, headers={"content-type": "application/json",
                                                            "x-request-id": request_id})
            statuses[request_id] = str(answer.status_code)
        # Lines are written in order: once a later request's line is out, every earlier one is too.
        http.post("/v1/completions", json={"model": MODEL, "prompt": "marker", "max_tokens": 1},
                  headers={"x-request-id": "log-marker"})
    wait_until(lambda: request_log_lines(gw, "log-marker"), what="the marker's request log line", timeout=5.0)
    assert statuses["log-chat"] == statuses["log-completion"] == "200"
    for request_id in sent:
        lines = request_log_lines(gw, request_id)
        assert len(lines) == 1, (request_id, lines)
        assert lines[0]["status"] == statuses[request_id], request_id  # one type, whatever the outcome


def test_requests_without_an_id_get_distinct_ones(client: openai.OpenAI) -> None:
    ids = {
        client.completions.with_raw_response.create(model=MODEL, prompt="id please", max_tokens=1).headers["x-request-id"]
        for _ in range(3)
    }
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_chat_streaming_through_kvgate(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "stream to me"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-kvgate-replica"].startswith("sim-")
    assert raw.headers["x-kvgate-decision"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 6


def test_models_lists_the_fleet_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_repeated_prompt_is_routed_warm_and_explained(client: openai.OpenAI, gw: Gateway) -> None:
    prompt = "the shared document " * 60
    first = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    warm = first.headers["x-kvgate-replica"]

    def held() -> dict | None:
        body = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=5).json()
        row = next(r for r in body["replicas"] if r["name"] == warm)
        return body if row["cached_tokens"]["gpu"] >= 16 else None

    explained = wait_until(held)
    assert explained["prompt_tokens"] > 100 and explained["approximate"] is False
    assert explained["decision"]["replica"] == warm and explained["decision"]["action"] == "route"
    assert {"queue_delay_ms", "predicted_ttft_ms", "generation", "healthy"} <= set(explained["replicas"][0])
    assert "per_token_ms" in explained["cost_model"]
    again = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.headers["x-kvgate-replica"] == warm
    assert again.headers["x-kvgate-decision"] == "warm"


def test_a_session_is_new_until_a_replica_has_served_it(client: openai.OpenAI, gw: Gateway) -> None:
    """The first request of an X-Session-ID is priced for the session's later turns on each replica (explain's
    ``session_load_ms``); once a replica has served it, the session is placed and its requests are priced alone."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a new session " * 30}]}

    def explain() -> dict:
        return httpx.post(gw.url + "/kvgate/v1/explain", json=body, headers={"X-Session-ID": "placed-once"},
                          timeout=5).json()

    first = explain()
    assert first["new_session"] is True
    priced = [row["session_load_ms"] for row in first["replicas"] if "session_load_ms" in row]
    assert priced and all(ms >= 0 for ms in priced)
    client.chat.completions.create(**body, max_tokens=1, extra_headers={"X-Session-ID": "placed-once"})
    again = explain()
    assert again["new_session"] is False
    assert all("session_load_ms" not in row for row in again["replicas"])


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": "not a list"}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
         400, "stream"),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(), 404,
         "model"),
    ],
)
def test_bad_input_gets_openai_error(gw: Gateway, content: bytes, status: int, param: str | None) -> None:
    r = httpx.post(gw.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_body_over_limit_is_413_by_length_and_by_stream(gw: Gateway) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * 300_000}).encode()
    r = httpx.post(gw.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        for i in range(0, len(big), 16384):
            yield big[i : i + 16384]

    r = httpx.post(gw.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_route_and_method_are_openai_errors(gw: Gateway) -> None:
    r = httpx.get(gw.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_ready_health_and_metrics(gw: Gateway, client: openai.OpenAI) -> None:
    assert httpx.get(gw.url + "/health").status_code == 200
    assert httpx.get(gw.url + "/ready").status_code == 200
    client.completions.create(model=MODEL, prompt="count me", max_tokens=1)
    assert metric_value(gw, "kvgate_requests_total", status="200") >= 1
    assert metric_value(gw, "kvgate_in_flight", replica="sim-0") == 0
    assert metric_value(gw, "kvgate_breaker_state", replica="sim-0", state="closed") == 1
    assert metric_value(gw, "kvgate_index_entries") >= 0
    assert metric_value(gw, "kvgate_rejections_total") >= 0


def scrape(gw: Gateway) -> dict[str, Metric]:
    """The gateway's /metrics page as metric families by name (counters named without ``_total``)."""
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Metric], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` (e.g. ``x_total``, ``x_bucket``) with these labels, over every family."""
    return sum(
        s.value for f in families.values() for s in f.samples if s.name == name and labels.items() <= s.labels.items()
    )


def test_metrics_say_whether_caching_pays(gw: Gateway, client: openai.OpenAI, sim: Sim) -> None:
    before = scrape(gw)
    prompt = "the metered document " * 60
    first = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    warm = first.headers["x-kvgate-replica"]

    def held() -> bool:
        body = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=5).json()
        return next(r for r in body["replicas"] if r["name"] == warm)["cached_tokens"]["gpu"] >= 16

    wait_until(held)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens > 100
    after = scrape(gw)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("kvgate_index_lookup_seconds_count") >= 2
    assert 0 < sample(after, "kvgate_index_lookup_seconds_sum") < 1.0
    assert delta("kvgate_matched_tokens_count") == 2
    assert delta("kvgate_matched_tokens_sum") >= 16  # the repeat matched the first one's blocks
    assert delta("kvgate_matched_tokens_bucket", le="0.0") == 1  # the first one matched nothing
    assert delta("kvgate_prefill_avoided_seconds_total") > 0
    # the index's view of each replica, and every drop reason and replication outcome from the start
    assert {s.labels["replica"] for s in after["kvgate_events_generation"].samples} == {
        f"sim-{i}" for i in range(sim.replicas)
    }
    assert {s.labels["reason"] for s in after["kvgate_events_dropped"].samples} == set(DROP_REASONS)
    assert {s.labels["result"] for s in after["kvgate_transfers"].samples} == {
        "started", "completed", "failed", "fallback"
    }
    assert sample(after, "kvgate_replication_started_total", reason="hot-prefix") == 0
    assert sample(after, "kvgate_events_applied_total") > 0
    # monotonic numbers are counters, and no *_created noise
    for name in ("kvgate_events_applied", "kvgate_events_dropped", "kvgate_index_evictions",
                 "kvgate_tokenizer_prompts", "kvgate_replication_started", "kvgate_config_reloads_ok"):
        assert after[name].type == "counter", name
    assert not [s.name for f in after.values() for s in f.samples if s.name.endswith("_created")]


def test_stopped_replica_is_retried_elsewhere(sim: Sim, rr_gw: Gateway) -> None:
    rr = openai.OpenAI(base_url=rr_gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    sim_fault(sim, 0, "stop", 2)
    try:
        served = [
            rr.completions.with_raw_response.create(model=MODEL, prompt=f"retry me {i}", max_tokens=1)
            for i in range(6)
        ]
    finally:
        sim_fault(sim, 0, "start", 2)
    assert all(r.http_response.status_code == 200 for r in served)
    assert "sim-2" not in {r.headers["x-kvgate-replica"] for r in served}
    assert metric_value(rr_gw, "kvgate_retries_total", cause="connect") >= 1


def test_replica_stopped_mid_stream_ends_with_error_event(sim: Sim, gw: Gateway) -> None:
    with httpx.stream(
        "POST", gw.url + "/v1/completions", timeout=30,
        json={"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "stream": True},
    ) as r:
        assert r.status_code == 200
        replica = int(r.headers["x-kvgate-replica"].split("-")[1])
        events: list[str] = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                sim_fault(sim, (replica + 1) % sim.replicas, "stop", replica)
    try:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_stream_error"
        chunks = [json.loads(e) for e in events[:-2]]
        assert len({c["id"] for c in chunks}) == 1  # one generation only: nothing was retried or duplicated
        assert 3 <= len(chunks) < 2000
    finally:
        sim_fault(sim, (replica + 1) % sim.replicas, "start", replica)
        wait_until(lambda: metric_value(gw, "kvgate_replica_healthy", replica=f"sim-{replica}") == 1)


def test_client_disconnect_aborts_the_upstream_request(sim: Sim, gw: Gateway) -> None:
    request_id = "disconnect-me-1"
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": request_id},
        json={"model": MODEL, "messages": [{"role": "user", "content": "talk a lot"}], "max_tokens": 3000,
              "stream": True},
    ) as r:
        replica = int(r.headers["x-kvgate-replica"].split("-")[1])
        next(r.iter_lines())

    def status() -> str | None:
        seen = [x for x in sim_requests(sim, replica) if x["headers"]["x-request-id"] == request_id]
        return seen[0]["status"] if seen and seen[0]["status"] != "running" else None

    assert wait_until(status, timeout=5) == "aborted"
    wait_until(lambda: metric_value(gw, "kvgate_client_disconnects_total") >= 1)
    assert metric_value(gw, "kvgate_in_flight", replica=f"sim-{replica}") == 0


def test_sigterm_lets_the_in_flight_stream_finish(sim: Sim, workdir: Path) -> None:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "kvgate-shutdown.yaml"))
    try:
        events: list[str] = []
        with httpx.stream(
            "POST", g.url + "/v1/completions", timeout=30,
            json={"model": MODEL, "prompt": "finish me", "max_tokens": 120, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        threading.Thread(target=g.process.signal, args=(signal.SIGTERM,)).start()
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert sum(1 for e in events if e.startswith("{") and json.loads(e)["choices"]) == 120
        assert g.process.proc is not None and g.process.proc.wait(10) is not None
    finally:
        g.stop()


def test_client_leaving_before_the_first_byte_aborts_the_upstream_request(sim: Sim, gw: Gateway) -> None:
    request_id = "leave-early-1"

    def ours() -> list[dict]:
        return [x for i in range(sim.replicas) for x in sim_requests(sim, i)
                if x["headers"]["x-request-id"] == request_id]

    for i in range(sim.replicas):
        httpx.post(sim.url(i) + "/sim/fault", json={"action": "stall"}, timeout=5).raise_for_status()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gw.url + "/v1/completions", timeout=1.0, headers={"X-Request-Id": request_id},
                json={"model": MODEL, "prompt": "never answered " * 50, "max_tokens": 5},
            )
        assert wait_until(lambda: [x["status"] for x in ours() if x["status"] != "running"], timeout=5) == ["aborted"]
    finally:
        for i in range(sim.replicas):
            httpx.post(sim.url(i) + "/sim/fault", json={"action": "unstall"}, timeout=5).raise_for_status()
    assert len(ours()) == 1
    wait_until(lambda: metric_value(gw, "kvgate_requests_total", status="499") == 1)


def test_a_role_chunk_is_not_the_first_token(sim: Sim, gw: Gateway) -> None:
    """The sim opens a chat stream with a role-only chunk before it prefills (some engines do): kvgate keeps counting
    the prompt as prefill still waiting on that replica (the cost policy's queue delay) until a token arrives."""
    events: list[str] = []
    request_id = "role-first-1"

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "role first " * 200}], "max_tokens": 3,
                "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=15,
                          headers={"X-Request-Id": request_id}) as resp:
            events.extend(line[6:] for line in resp.iter_lines() if line.startswith("data: "))

    def reached_the_sim() -> bool:
        return any(x["headers"]["x-request-id"] == request_id for i in range(sim.replicas) for x in sim_requests(sim, i))

    for i in range(sim.replicas):
        httpx.post(sim.url(i) + "/sim/fault", json={"action": "stall"}, timeout=5).raise_for_status()
    client = threading.Thread(target=stream)
    client.start()
    try:
        # The sim records a request and writes its role chunk in one go, before its stalled engine can prefill;
        # kvgate has read that chunk by the time it answers the next scrape.
        wait_until(reached_the_sim, "the request on a replica")
        assert metric_value(gw, "kvgate_in_flight{") == 1
        assert metric_value(gw, "kvgate_in_flight_prefill_tokens{") > 200
    finally:
        for i in range(sim.replicas):
            httpx.post(sim.url(i) + "/sim/fault", json={"action": "unstall"}, timeout=5).raise_for_status()
        client.join(15)
    assert events[-1] == "[DONE]" and any('"content":"' in e and '"role"' not in e for e in events)
    wait_until(lambda: metric_value(gw, "kvgate_in_flight_prefill_tokens{") == 0 and metric_value(gw, "kvgate_in_flight{") == 0)


def test_kv_events_over_http_feed_the_index(sim: Sim, workdir: Path) -> None:
    """A replica with no ZMQ endpoint (here a second name for sim-0's URL) is indexed from events POSTed to kvgate."""
    config = yaml.safe_load(gateway_config(sim, workdir, "kvgate-events-base.yaml").read_text())
    config["replicas"] = [{"name": "http-fed", "url": sim.url(0)}]
    config["server"] = {"events_token": "engine-events-token"}
    auth = {"authorization": "Bearer engine-events-token"}
    path = workdir / "kvgate-events.yaml"
    path.write_text(yaml.safe_dump(config))
    g = start_kvgate(workdir, path)
    try:
        tokens = list(range(1000, 1032))
        batch = KVEventBatch(time.time(), [BlockStored(
            block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens, block_size=16, lora_id=None,
            medium="GPU", lora_name=None,
        )], 0)
        r = httpx.post(g.url + "/kvgate/v1/events", content=msgspec.msgpack.encode(batch), headers={
            "content-type": "application/msgpack", "x-kvgate-replica": "http-fed", "x-kvgate-seq": "0", **auth})
        assert r.status_code == 200 and r.json()["status"] == "applied"
        explained = httpx.post(g.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": tokens + [7]}).json()
        assert explained["replicas"][0]["cached_tokens"]["gpu"] == 32
        r = httpx.post(g.url + "/kvgate/v1/events", content=b"x", headers={"content-type": "text/plain", **auth})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_events"
        r = httpx.post(g.url + "/kvgate/v1/events", content=b"\xc1garbage", headers={
            "content-type": "application/msgpack", "x-kvgate-replica": "http-fed", "x-kvgate-seq": "1", **auth})
        assert r.status_code == 200 and r.json()["status"] == "malformed"
    finally:
        g.stop()


def test_bad_policy_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: []\nproxy:\n  max_attempts: 0\n")
    done = subprocess.run([*KVGATE, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 2
    assert "proxy.max_attempts" in done.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_serves_in_front_of_its_own_fleet_and_stops_it(tmp_path: Path, stop_signal: int) -> None:
    port, sim_port, zmq_port = free_port_block(1), free_port_block(4), free_port_block(8)
    demo = ChildProcess(
        "kvgate demo", [*KVGATE, "demo", "--port", str(port), "--sim-port", str(sim_port), "--sim-zmq-port", str(zmq_port),
         "--time-scale", "0"], tmp_path / "demo.log",
    ).start()
    try:
        demo.wait_http(f"http://127.0.0.1:{port}/ready", 60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].message.content
        assert "openai" in demo.output() and "curl" in demo.output()
        assert demo.proc is not None
        demo.proc.send_signal(stop_signal)  # kvgate shuts down gracefully, then the demo stops its sim
        assert demo.proc.wait(20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{sim_port}/health", timeout=2)
    finally:
        demo.stop()
