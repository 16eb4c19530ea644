"""The agents' APIs through kvgate to real vLLM replicas, with the official SDKs as callers: Anthropic Messages (Claude
Code's) and OpenAI Responses (Codex's), streamed and not, multi-turn tool use, count_tokens, a stored response
followed up by id. On every turn kvgate's count of the prompt equals the engine's, what it credited as cached equals
what the engine reused, and the second turn goes warm to the first turn's replica. And the engine's own renderer
(``/v1/chat/completions/render``) gives kvgate's token ids for the golden chat templates' conversations."""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvgate.loadgen.engines import MODEL_NAME, VllmReplica
from kvgate.router.prompts.prompt import PromptError
from tests.engines.conftest import explain, start_gateway, unique_text, wait_for, write_fleet_file
from tests.support import Gateway, request_log_line
from tests.unit import test_chat_templates_golden as golden

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_FUNCTION = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"], "strict": False}
"""The same tool as a Responses function tool (Codex's shape)."""
APIS = ("chat", "completions", "messages", "count_tokens", "responses")


def anthropic_client(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=120.0)


def openai_client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def assert_counts_agree(line: dict[str, Any], engine_prompt_tokens: int | None = None) -> None:
    """kvgate tokenized the prompt as the engine did (its count is the engine's, when the caller has that from the
    answer's usage), and credited what the engine reused."""
    assert line["status"] == "200", line
    assert line["matched_tokens"] == line["cached_tokens"], line
    if engine_prompt_tokens is not None:
        assert line["prompt_tokens"] == engine_prompt_tokens, line


def parity(gw: Gateway, api: str, result: str, counts: str = "prompt_tokens") -> float:
    """``kvgate_parity_<counts>_total`` of one API and result: ``prompt_tokens`` (match, mismatch) or
    ``cached_tokens`` (match, credited_not_reused, reused_not_credited)."""
    text = httpx.get(gw.url + "/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"kvgate_parity_{counts}_total{{") and f'api="{api}"' in line
               and f'result="{result}"' in line)


def parity_mismatches(gw: Gateway) -> float:
    return sum(parity(gw, api, "mismatch") for api in APIS)


def cached_parity_errors(gw: Gateway) -> float:
    """Answers whose credited cache differed from what the engine reused by a block or more, either way: crediting a
    cache that was not used routes to the wrong replica; reuse not credited is a warm replica kvgate did not see."""
    return sum(parity(gw, api, result, "cached_tokens") for api in APIS
               for result in ("credited_not_reused", "reused_not_credited"))


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
    assert parity(kvgate, "messages", "match", "cached_tokens") == 2 and cached_parity_errors(kvgate) == 0


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

    with client.responses.with_streaming_response.create(model=MODEL_NAME, previous_response_id=second.id,
                                                         input="Go on.", max_output_tokens=4, stream=True) as raw:
        headers = raw.headers
        events = list(raw.parse())
    completed = [e for e in events if e.type == "response.completed"]
    assert completed and completed[0].response.usage is not None
    assert headers["x-kvgate-replica"] == replica  # the stored conversation's replica
    # No instructions this time, and instructions do not carry over: the prompt starts with the first user message, a
    # prefix nothing cached, so exact counts here are 0 credited for 0 reused.
    assert_counts_agree(request_log_line(kvgate, headers["x-request-id"]), completed[0].response.usage.input_tokens)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 56)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, previous_response_id="resp_made_up", input="x", max_output_tokens=2)
    assert parity_mismatches(kvgate) == 0
    assert parity(kvgate, "responses", "match", "cached_tokens") == 3 and cached_parity_errors(kvgate) == 0


def test_responses_multi_turn_tool_use_goes_warm_with_exact_counts(kvgate: Gateway) -> None:
    """Codex's loop: a first turn with tools and instructions; the model's function call (built here, as an agent
    replays its history: the tiny model calls no tools) and its output sent back as input items, streamed. The
    second turn's prompt starts with the first's, so kvgate must send it warm to the first turn's replica and credit
    exactly what that engine reuses."""
    client = openai_client(kvgate)
    instructions = "You are a coding agent. " + unique_text(300)
    question = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}
    raw = client.responses.with_raw_response.create(model=MODEL_NAME, instructions=instructions,
                                                    tools=[WEATHER_FUNCTION], input=[question], max_output_tokens=4)
    first = raw.parse()
    assert first.usage is not None and first.usage.output_tokens > 0
    replica = raw.headers["x-kvgate-replica"]
    assert_counts_agree(request_log_line(kvgate, raw.headers["x-request-id"]), first.usage.input_tokens)

    history = [question,
               {"type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
               {"type": "function_call", "call_id": "call_weather_1", "name": "get_weather",
                "arguments": json.dumps({"city": "Paris"})},
               {"type": "function_call_output", "call_id": "call_weather_1", "output": "rain, 14°C"}]
    with client.responses.with_streaming_response.create(model=MODEL_NAME, instructions=instructions,
                                                         tools=[WEATHER_FUNCTION], input=history,
                                                         max_output_tokens=4, stream=True) as raw:
        headers = raw.headers
        events = list(raw.parse())
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    usage = events[-1].response.usage
    assert usage is not None and usage.output_tokens > 0
    assert headers["x-kvgate-replica"] == replica  # warm: the first turn's prefix is there
    assert (usage.input_tokens_details.cached_tokens or 0) > 0
    second = request_log_line(kvgate, headers["x-request-id"])
    assert_counts_agree(second, usage.input_tokens)
    assert second["matched_tokens"] > 0
    assert parity(kvgate, "responses", "match") == 2 and parity_mismatches(kvgate) == 0
    assert parity(kvgate, "responses", "match", "cached_tokens") == 2 and cached_parity_errors(kvgate) == 0


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


golden_served = golden.served
"""kvgate's renderer for each of vllm_rendered.json's model setups: the golden unit test's fixture, reused."""
UNSET_KWARGS = (None, "auto")
"""Template variables a request leaves to the server's defaults (vLLM's ``merge_kwargs`` drops them)."""
PER_REQUEST = frozenset({"chat_template", "default_kwargs"})
RENDERED_PER_REQUEST = [name for name, entry in golden.VLLM["models"].items() if set(entry["setup"]) <= PER_REQUEST]
"""The golden fixture's model setups a request can reproduce on the running engines (whose tokenizer is the shipped
one, as the fixture's is): the request's own template for ``--chat-template``, and ``--default-chat-template-kwargs``
under the request's kwargs. Content formats and changed tokenizer files are server-wide: those setups stay with the
unit test."""


def as_served_with(setup: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a request the running engine renders as a server started with ``setup``'s flags renders ``body``."""
    request = {"model": MODEL_NAME, **copy.deepcopy(body)}
    if "chat_template" in setup:
        request["chat_template"] = (golden.FIXTURES / setup["chat_template"]).read_text(encoding="utf-8")
    defaults = setup.get("default_kwargs")
    if defaults:
        own = request.get("chat_template_kwargs") or {}
        request["chat_template_kwargs"] = {**defaults, **{k: v for k, v in own.items() if v not in UNSET_KWARGS}}
    return request


def engine_render(replica: VllmReplica, request: dict[str, Any]) -> list[int] | str:
    """The prompt ids the engine would run for a chat completions ``request`` (its render endpoint: the chat path's
    own renderer, nothing generated), or its refusal."""
    resp = httpx.post(replica.url + "/v1/chat/completions/render", json=request, timeout=30.0)
    if resp.status_code != 200:
        return f"refused {resp.status_code}: {resp.text[:300]}"
    return resp.json()["token_ids"]


def first_difference(engine: list[int], ours: list[int]) -> str:
    """Where two renderings part and what each has there: what a report of a template's discrepancy needs."""
    at = next((i for i, (a, b) in enumerate(zip(engine, ours)) if a != b), min(len(engine), len(ours)))
    return (f"first difference at token {at} of engine {len(engine)} / kvgate {len(ours)}: engine "
            f"{engine[at:at + 8]} kvgate {ours[at:at + 8]} (after {engine[max(0, at - 4):at]})")


@pytest.mark.parametrize("model", RENDERED_PER_REQUEST)
async def test_the_engine_renders_the_golden_chats_as_kvgate_does(
    replicas: list[VllmReplica], golden_served: dict[str, golden.Served], model: str,
) -> None:
    """The golden unit test holds kvgate to ids vLLM rendered offline when the fixture was recorded; here the running
    engine renders the same conversations with the same templates, so a renderer that changed in the engine, or a
    path the offline recording did not take (the server's request handling), shows as a difference. Every case's
    ids must be kvgate's, and what the engine refuses kvgate refuses."""
    setup = golden.VLLM["models"][model]["setup"]
    differences: list[str] = []
    for case, body in golden.VLLM["chat"].items():
        engine = engine_render(replicas[0], as_served_with(setup, body))
        ours: list[int] | str
        try:
            ours = await golden.kvgate_ids(golden_served[model], "chat", case)
        except PromptError as err:
            ours = f"refused: {err}"
        recorded = golden.VLLM["expected"][model]["chat"][case]
        if isinstance(engine, str) or isinstance(ours, str):
            if isinstance(engine, str) != isinstance(ours, str):
                differences.append(f"{case}: engine {engine if isinstance(engine, str) else 'renders'}, kvgate "
                                   f"{ours if isinstance(ours, str) else 'renders'} (recorded: "
                                   f"{recorded.get('error', 'renders')})")
        elif engine != ours:
            fixture = "the recording agrees with the engine" if recorded.get("ids") == engine else (
                "the recording agrees with kvgate" if recorded.get("ids") == ours else "the recording is a third")
            differences.append(f"{case}: {first_difference(engine, ours)}; {fixture}")
    assert not differences, f"{model}:\n" + "\n".join(differences)
