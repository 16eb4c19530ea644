"""The agents' APIs through a real kvgate in front of a real ``kvgate sim`` fleet, with tenants configured and the
official SDKs as callers: Anthropic Messages (``x-api-key``, as Claude Code authenticates) and count_tokens, OpenAI
Responses with the engine's store, the passthrough surface, and the parity monitor catching a configured chat
template the engines do not use, then recovering once the policy file is fixed."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.support import Gateway, Sim, request_log_line, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN = "admin-token-agent-apis"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def policy_file(sim: Sim, path: Path, **sections: Any) -> Path:
    config = yaml.safe_load(sim.config_path.read_text())
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config["server"] = {"admin_token": ADMIN}
    config["tenants"] = {"api_keys": KEYS, "salt_secret": "agent-apis-salt-secret"}
    config.update(sections)
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # the sim reads vLLM's own switch at start
        s = start_sim(tmp_path_factory.mktemp("sim-gw-agentic"), 2, "--time-scale", "0.01")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("gw-agentic")
    g = start_kvgate(workdir, policy_file(sim, workdir / "kvgate.yaml"))
    yield g
    g.stop()


def claude(gw: Gateway, key: str = "sk-alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, timeout=15.0, max_retries=0)


def codex(gw: Gateway, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=15.0, max_retries=0)


def unique(words: int = 120) -> str:
    return f"{uuid.uuid4()} " + " ".join(f"line{i} of the repository" for i in range(words))


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name and all(f'{k}="{v}"' in line for k, v in labels.items()))


def sim_saw(sim: Sim, request_id: str) -> bool:
    for i in range(sim.replicas):
        seen = httpx.get(sim.url(i) + "/sim/requests", params={"limit": 1000}, timeout=5).json()["requests"]
        if any(r["headers"].get("x-request-id") == request_id for r in seen):
            return True
    return False


def test_claude_code_turns_go_warm_with_counts_equal_to_the_engines(gw: Gateway) -> None:
    client = claude(gw)
    system = [{"type": "text", "text": "You are a coding agent. " + unique(),
               "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": [{"type": "text", "text": "Open main.py",
                                           "cache_control": {"type": "ephemeral"}}]}]
    session = {"x-claude-code-session-id": str(uuid.uuid4())}
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=system, tools=TOOLS,  # type: ignore[arg-type]
                                                   messages=first, extra_headers=session)
    reply = raw.parse()
    assert reply.type == "message" and reply.usage.output_tokens == 4
    replica = raw.headers["x-kvgate-replica"]
    line = request_log_line(gw, raw.headers["x-request-id"])
    assert line["api"] == "messages" and line["status"] == "200"
    usage = reply.usage  # Anthropic's total input: uncached + read from the cache + written to it
    assert line["prompt_tokens"] == usage.input_tokens + (usage.cache_read_input_tokens or 0) + (
        usage.cache_creation_input_tokens or 0)

    second = [*first,
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                 "input": {"path": "main.py"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
                                           {"type": "text", "text": "Explain it.",
                                            "cache_control": {"type": "ephemeral"}}]}]
    with client.messages.stream(model=MODEL, max_tokens=4, system=system, tools=TOOLS,  # type: ignore[arg-type]
                                messages=second, extra_headers=session) as stream:
        assert list(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert headers["x-kvgate-replica"] == replica
    assert (final.usage.cache_read_input_tokens or 0) > 0
    line = request_log_line(gw, headers["x-request-id"])
    assert line["stream"] is True and line["matched_tokens"] == line["cached_tokens"] > 0

    before = metric(gw, "kvgate_parity_prompt_tokens_total", api="count_tokens", result="match")
    counted = client.messages.count_tokens(model=MODEL, system=system, tools=TOOLS,  # type: ignore[arg-type]
                                           messages=second)
    assert counted.input_tokens == line["prompt_tokens"]  # the same conversation, counted as the engine renders it
    assert metric(gw, "kvgate_parity_prompt_tokens_total", api="count_tokens", result="match") == before + 1
    assert metric(gw, "kvgate_parity_prompt_tokens_total", result="mismatch") == 0


def test_a_bad_messages_body_gets_anthropics_error_shape_and_no_replica_sees_it(gw: Gateway, sim: Sim) -> None:
    request_id = f"bad-{uuid.uuid4()}"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(gw).messages.create(model=MODEL, max_tokens=4, extra_headers={"X-Request-Id": request_id},
                                   messages=[{"role": "user", "content": [{"type": "nonsense"}]}])  # type: ignore[list-item]
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert not sim_saw(sim, request_id)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        claude(gw, key="sk-nobody").messages.create(model=MODEL, max_tokens=4,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error"


def test_a_bad_count_tokens_body_gets_anthropics_error_shape_and_no_replica_sees_it(gw: Gateway, sim: Sim) -> None:
    """count_tokens answers through its own flow (not the generation one): its refusals must be Anthropic's too."""
    request_id = f"bad-count-{uuid.uuid4()}"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(gw).messages.count_tokens(model=MODEL, extra_headers={"X-Request-Id": request_id},
                                         messages=[{"role": "bogus", "content": "hi"}])  # type: ignore[list-item]
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    raw = httpx.post(gw.url + "/v1/messages/count_tokens", content=b'{"model": "kvgate-sim", "messages": 7}',
                     headers={"x-api-key": "sk-alice", "content-type": "application/json"}, timeout=5)
    assert raw.status_code == 400
    body = raw.json()
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert not sim_saw(sim, request_id)


def test_a_bad_responses_body_gets_openais_error_shape_and_no_replica_sees_it(gw: Gateway, sim: Sim) -> None:
    """Codex and the Agents SDK read OpenAI's shape: message, type, param (the field at fault) and code."""
    request_id = f"bad-responses-{uuid.uuid4()}"
    with pytest.raises(openai.BadRequestError) as caught:
        codex(gw).responses.create(model=MODEL, input=[{"type": "nonsense"}],  # type: ignore[list-item]
                                   max_output_tokens=4, extra_headers={"X-Request-Id": request_id})
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}  # the SDK unwraps "error"
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] is not None and error["param"].startswith("input")
    raw = httpx.post(gw.url + "/v1/responses", content=b'{"model": "kvgate-sim", "input": 7}',
                     headers={"Authorization": "Bearer sk-alice", "content-type": "application/json"}, timeout=5)
    assert raw.status_code == 400 and set(raw.json()) == {"error"}, raw.text
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert raw.json()["error"]["type"] == "invalid_request_error" and raw.json()["error"]["param"] == "input"
    assert not sim_saw(sim, request_id)


def test_a_stored_response_is_followed_on_its_replica_and_private_to_its_tenant(gw: Gateway) -> None:
    client = codex(gw)
    raw = client.responses.with_raw_response.create(model=MODEL, input=unique(), store=True,
                                                    instructions="Answer briefly.", max_output_tokens=4)
    first = raw.parse()
    replica = raw.headers["x-kvgate-replica"]
    assert first.id.startswith("resp_") and first.usage is not None

    raw = client.responses.with_raw_response.create(model=MODEL, previous_response_id=first.id, input="And then?",
                                                    instructions="Answer briefly.", max_output_tokens=4)
    second = raw.parse()
    assert raw.headers["x-kvgate-replica"] == replica
    assert second.usage is not None and (second.usage.input_tokens_details.cached_tokens or 0) > 0
    line = request_log_line(gw, raw.headers["x-request-id"])
    assert line["api"] == "responses" and line["matched_tokens"] == line["cached_tokens"]
    assert client.responses.retrieve(first.id).id == first.id

    events = list(client.responses.create(model=MODEL, previous_response_id=second.id, input="Go on.",
                                          max_output_tokens=4, stream=True))
    assert [e for e in events if e.type == "response.completed"]

    other = codex(gw, key="sk-bob")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)  # alice's id means nothing to bob: not even that it exists
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 56)


@pytest.mark.parametrize("words", [900, 1500])  # a body tokenized on the loop, and one parsed on a worker thread
def test_a_long_new_responses_input_is_routed_on_its_beginning_and_counted_whole(gw: Gateway, words: int) -> None:
    """A Codex turn carrying a long file the gateway never saw goes out before all of it is tokenized; its log line
    and the parity check still count the whole prompt, equal to the engine's, and its follow-up finds it cached."""
    client = codex(gw)
    routed_early = metric(gw, "kvgate_routed_on_prompt_beginning_total")
    matched = metric(gw, "kvgate_parity_prompt_tokens_total", api="responses", result="match")
    with client.responses.with_streaming_response.create(
        model=MODEL, input="Review this file:\n" + unique(words=words), store=True, instructions="Answer briefly.",
        max_output_tokens=4, stream=True,
    ) as raw:
        events = list(raw.parse())
        request_id = raw.headers["x-request-id"]
    (completed,) = [e for e in events if e.type == "response.completed"]
    usage = completed.response.usage
    assert usage is not None
    line = request_log_line(gw, request_id)
    assert line["api"] == "responses" and line["prompt_tokens"] == usage.input_tokens > 4000
    assert metric(gw, "kvgate_routed_on_prompt_beginning_total") == routed_early + 1
    assert metric(gw, "kvgate_parity_prompt_tokens_total", api="responses", result="match") == matched + 1
    assert metric(gw, "kvgate_parity_prompt_tokens_total", result="mismatch") == 0

    raw_next = client.responses.with_raw_response.create(
        model=MODEL, previous_response_id=completed.response.id, input="Any bugs?", instructions="Answer briefly.",
        max_output_tokens=4)
    follow_up = raw_next.parse()
    assert follow_up.usage is not None and (follow_up.usage.input_tokens_details.cached_tokens or 0) > 4000


def test_the_passthrough_surface_is_authenticated_and_parses_multipart_models(gw: Gateway) -> None:
    alice = {"Authorization": "Bearer sk-alice"}
    r = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "hello there"}, headers=alice, timeout=5)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    r = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=5)
    assert r.status_code == 401 and r.json()["error"]["type"]
    files = {"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")}
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "no-such-model"}, files=files, headers=alice,
                   timeout=5)
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]


def test_a_template_the_engines_do_not_use_is_caught_then_trusted_again_after_reload(
    sim: Sim, tmp_path: Path,
) -> None:
    config = yaml.safe_load(sim.config_path.read_text())
    tokenizer = Path(config["models"][0]["tokenizer"])
    own = json.loads((tokenizer / "tokenizer_config.json").read_text())["chat_template"]
    wrong = tmp_path / "wrong.jinja"
    wrong.write_text("{{ 'A different preamble.\\n' }}" + own)
    parity = {"window": 8, "untrust_after": 3, "recover_after": 4, "log_interval_s": 0}
    models = [{**config["models"][0], "chat_template": str(wrong)}]
    path = policy_file(sim, tmp_path / "kvgate.yaml", parity=parity, models=models)
    g = start_kvgate(tmp_path, path)
    try:
        client = codex(g)
        admin = {"Authorization": f"Bearer {ADMIN}"}

        def ask() -> None:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": unique(20)}],
                                           max_tokens=1)

        for _ in range(3):
            ask()
        assert metric(g, "kvgate_parity_prompt_tokens_total", api="chat", result="mismatch") == 3
        assert metric(g, "kvgate_parity_trusted", model=MODEL) == 0
        replicas = httpx.get(g.url + "/admin/replicas", headers=admin, timeout=5).json()
        assert replicas["parity"][MODEL]["trusted"] is False
        assert "parity" in g.process.output()  # the warning names what disagrees

        policy_file(sim, path, parity=parity)  # the engines' own template again
        wait_until(lambda: metric(g, "kvgate_config_reloads_ok_total") >= 1, "the reload", timeout=30.0)
        for _ in range(4):
            ask()
        assert metric(g, "kvgate_parity_trusted", model=MODEL) == 1
    finally:
        g.stop()
