"""The agents' APIs through kvgate to real vLLM replicas, with the official SDKs as callers: Anthropic Messages (Claude
Code's) and OpenAI Responses (Codex's), streamed and not, multi-turn tool use, count_tokens, a stored response
followed up by id. On every turn kvgate's count of the prompt equals the engine's, what it credited as cached equals
what the engine reused, and the second turn goes warm to the first turn's replica."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvgate.loadgen.engines import MODEL_NAME
from tests.engines.conftest import explain, start_gateway, unique_text, wait_for, write_fleet_file
from tests.support import Gateway, request_log_line

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def anthropic_client(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=120.0)


def openai_client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def assert_counts_agree(line: dict[str, Any]) -> None:
    """kvgate tokenized the prompt as the engine did, and credited what the engine reused."""
    assert line["status"] == "200", line
    assert line["matched_tokens"] == line["cached_tokens"], line


def parity(gw: Gateway, api: str, result: str) -> float:
    """``kvgate_parity_prompt_tokens_total`` of one API and result."""
    text = httpx.get(gw.url + "/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvgate_parity_prompt_tokens_total{") and f'api="{api}"' in line
               and f'result="{result}"' in line)


def parity_mismatches(gw: Gateway) -> float:
    return sum(parity(gw, api, "mismatch") for api in ("chat", "completions", "messages", "count_tokens", "responses"))


def test_messages_multi_turn_tool_use_goes_warm_with_exact_counts(kvgate: Gateway) -> None:
    client = anthropic_client(kvgate)
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=9f3"},
              {"type": "text", "text": "You are a coding agent. " + unique_text(300),
               "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?",
                                           "cache_control": {"type": "ephemeral"}}]}]
    raw = client.messages.with_raw_response.create(model=MODEL_NAME, max_tokens=4, system=system, tools=[WEATHER],
                                                   messages=first, extra_headers={"x-claude-code-session-id": "s-1"})
    reply = raw.parse()
    assert reply.type == "message" and reply.usage.output_tokens > 0
    replica = raw.headers["x-kvgate-replica"]
    assert_counts_agree(request_log_line(kvgate, raw.headers["x-request-id"]))

    second = [*first,
              {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain, 14°C"},
                                           {"type": "text", "text": "Should I take an umbrella?"}]}]
    with client.messages.stream(model=MODEL_NAME, max_tokens=4, system=system, tools=[WEATHER], messages=second,
                                extra_headers={"x-claude-code-session-id": "s-1"}) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert texts and final.usage.output_tokens > 0
    assert headers["x-kvgate-replica"] == replica  # warm: the first turn's prefix is there
    assert (final.usage.cache_read_input_tokens or 0) > 0
    assert_counts_agree(request_log_line(kvgate, headers["x-request-id"]))

    counted = client.messages.count_tokens(model=MODEL_NAME, system=system, tools=[WEATHER], messages=second)
    assert counted.input_tokens > 0
    assert parity(kvgate, "count_tokens", "match") == 1  # the engine's count is kvgate's
    assert parity(kvgate, "messages", "match") == 2 and parity_mismatches(kvgate) == 0


def test_messages_bad_bodies_get_anthropic_errors(kvgate: Gateway) -> None:
    client = anthropic_client(kvgate)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_responses_stored_follow_up_by_id_stays_on_its_replica(kvgate: Gateway) -> None:
    client = openai_client(kvgate)
    raw = client.responses.with_raw_response.create(model=MODEL_NAME, input=unique_text(300), store=True,
                                                    instructions="Answer briefly.", max_output_tokens=4)
    first = raw.parse()
    replica = raw.headers["x-kvgate-replica"]
    assert first.id.startswith("resp_") and first.usage is not None
    assert_counts_agree(request_log_line(kvgate, raw.headers["x-request-id"]))

    raw = client.responses.with_raw_response.create(model=MODEL_NAME, previous_response_id=first.id, input="And?",
                                                    instructions="Answer briefly.", max_output_tokens=4)
    second = raw.parse()
    assert raw.headers["x-kvgate-replica"] == replica
    assert second.usage is not None and (second.usage.input_tokens_details.cached_tokens or 0) > 0
    assert_counts_agree(request_log_line(kvgate, raw.headers["x-request-id"]))
    assert client.responses.retrieve(first.id).id == first.id

    events = list(client.responses.create(model=MODEL_NAME, previous_response_id=second.id, input="Go on.",
                                          max_output_tokens=4, stream=True))
    completed = [e for e in events if e.type == "response.completed"]
    assert completed and completed[0].response.usage is not None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 56)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, previous_response_id="resp_made_up", input="x", max_output_tokens=2)
    assert parity_mismatches(kvgate) == 0


def test_a_template_other_than_the_engines_is_caught_and_routes_approximately_until_fixed(
    replicas: list, engine_runtime: tuple, tmp_path: Any,
) -> None:
    """The policy file gives the model a chat template the engines do not use (one more line before each message):
    every prompt count disagrees, so within ``untrust_after`` requests kvgate stops trusting its keys; once the file
    says the engines' template again, ``recover_after`` agreeing counts restore exact routing."""
    model = engine_runtime[1]
    own = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    wrong = tmp_path / "wrong.jinja"
    wrong.write_text("{{ 'A different preamble.\\n' }}" + own)
    parity_config = {"window": 8, "untrust_after": 3, "recover_after": 4, "log_interval_s": 0}
    gw = start_gateway(tmp_path, "wrong-template", replicas, model, parity=parity_config,
                       models=[{"name": MODEL_NAME, "tokenizer": str(model), "chat_template": str(wrong)}])
    try:
        client = openai_client(gw)

        def ask() -> None:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": unique_text(40)}],
                                           max_tokens=1)

        for _ in range(3):
            ask()
        assert parity(gw, "chat", "mismatch") == 3
        explained = explain(gw, {"messages": [{"role": "user", "content": "hi"}]})
        assert explained["parity"]["trusted"] is False and explained["approximate"] is True
        write_fleet_file(gw.config_path, replicas, model, parity=parity_config)  # the engines' own template
        wait_for(lambda: reloaded(gw), 30.0, "the policy file's reload")
        for _ in range(4):
            ask()
        assert parity(gw, "chat", "match") == 4
        assert explain(gw, {"messages": [{"role": "user", "content": "hi"}]})["parity"]["trusted"] is True
    finally:
        gw.stop()


def reloaded(gw: Gateway) -> bool:
    text = httpx.get(gw.url + "/metrics", timeout=10.0).text
    return any(line.startswith("kvgate_config_reloads_ok_total ") and float(line.rsplit(" ", 1)[1]) >= 1
               for line in text.splitlines())
