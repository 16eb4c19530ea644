"""The sim's Anthropic Messages and OpenAI Responses APIs without a process: the chat conversation each request
becomes, the template probes, the answers' exact bytes, and the route table.

The expected prompts and conversations are vLLM 0.32's own (its conversion functions and transformers'
``apply_chat_template`` on the shipped tokenizer, notes §7); the expected events are what a vLLM 0.32 CPU server
streamed for the same requests, generated text and ids aside."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.loadgen.sim import anthropic, responses
from kvgate.loadgen.sim.answers import cache_creation_tokens
from kvgate.loadgen.sim.conversation import Conversation, render_text
from kvgate.loadgen.sim.engine import SimRequest
from kvgate.loadgen.sim.errors import BodyError, EngineError
from kvgate.loadgen.sim.model import SimModel
from kvgate.loadgen.sim.routes import Route, match
from kvgate.loadgen.sim.tokenizer import SimTokenizer

MODEL = "kvgate-sim"
MAX_MODEL_LEN = 8192
QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
             "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
             "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


@pytest.fixture(scope="module")
def model() -> SimModel:
    return SimModel.load(MODEL, TOKENIZER_DIR)


@pytest.fixture(scope="module")
def messages_api(model: SimModel) -> anthropic.MessagesApi:
    return anthropic.MessagesApi(model, MAX_MODEL_LEN, 16)


def checked(body: dict[str, Any]) -> dict[str, Any]:
    anthropic.check_request(body, count_tokens=True)
    return body


NOTES_MESSAGES_EXAMPLE = {
    "model": MODEL, "system": "S",
    "tools": [{"name": "get", "description": "d", "input_schema": {"properties": {"x": {"type": "string"}}}}],
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                          {"type": "tool_use", "id": "t1", "name": "get", "input": {"x": "é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "R"},
                                     {"type": "text", "text": "next"}]},
    ],
}


def test_a_messages_request_renders_as_vllm_renders_it(messages_api: anthropic.MessagesApi) -> None:
    body = checked(json.loads(json.dumps(NOTES_MESSAGES_EXAMPLE)))
    conversation = messages_api.conversation(body)
    assert conversation.messages == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "get", "arguments": '{"x": "\\u00e9"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "R"}, {"role": "user", "content": "next"},
    ]
    assert render_text(messages_api.model.tokenizer, conversation) == (
        '<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": "get", "description": "d", '
        '"parameters": {"properties": {"x": {"type": "string"}}, "type": "object"}}}\n</tools><|im_end|>\n'
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\na\nb<|im_end|>\n"
        "<|im_start|>tool\nR<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_results_come_out_ahead_of_their_turns_text() -> None:
    body = checked({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "A"}, {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"type": "text", "text": "B"}, {"type": "tool_result", "tool_use_id": "t2", "is_error": True, "content": "r3"},
    ]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3"}]}]})
    assert anthropic.chat_messages(body, merge_inline_system=False) == [
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "tool", "tool_call_id": "t2", "content": "r3"},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "tool", "tool_call_id": "t3", "content": ""},  # a turn of tool results only leaves no user message
    ]


def test_system_blocks_join_without_a_separator_and_lose_the_billing_header() -> None:
    body = checked({"model": MODEL, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1;"},
        {"type": "text", "text": "You are Claude Code. ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "reminder"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "redacted_thinking", "data": "x"}]}]})
    assert anthropic.chat_messages(body, merge_inline_system=False) == [
        {"role": "system", "content": "You are Claude Code. Be brief."}, {"role": "user", "content": "q"},
        {"role": "system", "content": "reminder"}, {"role": "assistant", "reasoning": "hm"},
    ]
    assert anthropic.chat_messages(body, merge_inline_system=True)[:2] == [
        {"role": "system", "content": "You are Claude Code. Be brief.reminder"}, {"role": "user", "content": "q"},
    ]


def test_a_string_system_keeps_all_but_the_billing_line(model: SimModel) -> None:
    conversation = Conversation([{"role": "system", "content": "x-anthropic-billing-header: cch=9;\nreal"},
                                 {"role": "user", "content": "q"}])
    assert render_text(model.tokenizer, conversation).startswith("<|im_start|>system\nreal<|im_end|>")


def test_the_inline_system_probe_runs_the_template_in_a_bare_sandbox(model: SimModel) -> None:
    assert model.tokenizer.chat_template is not None
    assert anthropic.merges_inline_system(model.tokenizer.chat_template.source) is False
    assert anthropic.merges_inline_system(QWEN_LIKE) is True
    assert anthropic.merges_inline_system("{% generation %}{{ messages }}{% endgeneration %}") is True
    assert anthropic.merges_inline_system("{{ strftime_now('%Y') }}") is True
    assert anthropic.merges_inline_system(None) is True


def test_disabled_thinking_maps_to_low_unless_the_template_renders_none_apart(messages_api: anthropic.MessagesApi,
                                                                             model: SimModel) -> None:
    assert messages_api.disabled_thinking_effort() == "low"  # the shipped template ignores the effort
    assert model.tokenizer.chat_template is not None
    source = model.tokenizer.chat_template.source + "{% if enable_thinking %}<think>{% endif %}"
    reads_effort = replace(model, tokenizer=SimTokenizer(model.tokenizer.tokenizer, {"chat_template": source}))
    assert anthropic.MessagesApi(reads_effort, MAX_MODEL_LEN, 16).disabled_thinking_effort() == "none"


def test_an_input_schema_without_type_gets_object_last() -> None:
    body = checked({"model": MODEL, "messages": [], "tools": [{"name": "t", "input_schema": {"properties": {}}}]})
    assert list(body["tools"][0]["input_schema"]) == ["properties", "type"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "body.model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "body.messages.0.content.0.type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "t"}}]}]}, "body.messages.0"),
    ({"model": MODEL, "messages": [], "tool_choice": {"type": "tool"}}, "body.tool_choice"),
    ({"model": MODEL, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 10}},
     "body.thinking.enabled.budget_tokens"),
])
def test_bodies_the_request_model_refuses_are_openai_shaped(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BodyError) as refused:
        anthropic.check_request(body, count_tokens=True)
    assert refused.value.body()["error"]["type"] == "Bad Request" and refused.value.param == param


def test_the_messages_body_checks() -> None:
    with pytest.raises(BodyError) as refused:
        anthropic.check_request({"model": MODEL, "messages": [], "max_tokens": 100,
                                 "thinking": {"type": "enabled", "budget_tokens": 2000}})
    assert refused.value.param == "body"
    with pytest.raises(BodyError) as refused:
        anthropic.check_request({"model": MODEL, "messages": [], "max_tokens": 1, "cache_salt": "s" * 1025})
    assert refused.value.param == "body.cache_salt"


def test_handler_errors_are_anthropic_shaped(messages_api: anthropic.MessagesApi) -> None:
    body = {"model": MODEL, "max_tokens": 1, "cache_salt": "a/b", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(EngineError) as refused:
        messages_api.prompt(body)
    assert anthropic.AnthropicError.of(refused.value).body() == {"type": "error", "error": {
        "type": "BadRequestError", "message": "Parameter 'cache_salt' must be at most 128 characters and must not "
                                              "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)"}}
    with pytest.raises(EngineError) as refused:
        messages_api.prompt({**body, "cache_salt": None, "model": "other"})
    assert refused.value.status == 404 and refused.value.kind == "NotFoundError"


def test_the_output_budget_is_clamped_to_the_context(messages_api: anthropic.MessagesApi) -> None:
    body = {"model": MODEL, "max_tokens": MAX_MODEL_LEN - 1, "messages": [{"role": "user", "content": "x"}]}
    ids = messages_api.prompt(body)
    assert messages_api.generation_options(body, len(ids))["max_tokens"] == MAX_MODEL_LEN - len(ids)
    with pytest.raises(EngineError, match="max_completion_tokens=8193 cannot be greater than max_model_len=8192"):
        messages_api.prompt({**body, "max_tokens": MAX_MODEL_LEN + 1})


def sim_request(model: SimModel, prompt_len: int, cached: int, tokens: int) -> SimRequest:
    req = SimRequest("r", prompt_len, tokens, [])
    req.cached_tokens = cached
    req.output = model.output_vocab[:tokens]
    return req


def events(stream: bytes) -> list[tuple[str, str]]:
    out = []
    for frame in stream.decode().split("\n\n")[:-1]:
        event, data = frame.split("\n")
        out.append((event.removeprefix("event: "), data.removeprefix("data: ")))
    return out


def test_a_message_streams_as_vllm_streams_it(model: SimModel) -> None:
    answer = anthropic.MessagesAnswer("abc", model, 32)
    req = sim_request(model, 207, 0, 2)
    stream = (answer.opening() + answer.first(req) + answer.token(req, req.output[0], False)
              + answer.token(req, req.output[1], True) + answer.closing(req))
    t0, t1 = (json.dumps(model.token_text[i], ensure_ascii=False) for i in req.output)
    assert events(stream) == [
        ("message_start", '{"type":"message_start","message":{"id":"chatcmpl-abc","type":"message",'
                          '"role":"assistant","content":[],"model":"kvgate-sim","stop_reason":null,'
                          '"stop_sequence":null,"usage":{"input_tokens":207,"output_tokens":0}}}'),
        ("content_block_start", '{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}'),
        *(("content_block_delta", '{"type":"content_block_delta","delta":{"type":"text_delta","text":%s},'
                                  '"index":0}' % t) for t in (t0, t1)),
        ("content_block_stop", '{"type":"content_block_stop","index":0}'),
        ("message_delta", '{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
                          '"usage":{"input_tokens":15,"output_tokens":2,"cache_creation_input_tokens":192,'
                          '"cache_read_input_tokens":0}}'),
        ("message_stop", '{"type":"message_stop"}'),
    ]


def test_message_usage_splits_the_prompt_into_read_written_and_neither(model: SimModel) -> None:
    answer = anthropic.MessagesAnswer("abc", model, 32)
    assert answer.body(sim_request(model, 207, 192, 2))["usage"] == {
        "input_tokens": 15, "output_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 192}
    # a prompt filling its last block exactly recomputes it: that block counts as written
    assert cache_creation_tokens(sim_request(model, 64, 32, 1), 32) == 32


NOTES_RESPONSES_ITEMS: list[dict[str, Any]] = [
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "o1"},
                                                         {"type": "output_text", "text": "o2"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "res1"},
]


def test_responses_items_merge_into_one_assistant_message() -> None:
    body = {"input": json.loads(json.dumps(NOTES_RESPONSES_ITEMS))}
    responses.check_request(body)
    assert responses.input_messages(body, None, None) == [
        {"role": "assistant", "reasoning": "think", "content": "o1", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
            {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "res1", "tool_call_id": "c1"},
    ]


def test_instructions_and_a_developer_message_consolidate_into_one_system(model: SimModel) -> None:
    api = responses.ResponsesApi(model, MAX_MODEL_LEN, 16, store=False)
    body = {"model": MODEL, "instructions": "I", "input": [{"role": "developer", "content": "D"},
                                                           {"role": "user", "content": "u"}]}
    turn = api.turn(body)
    expected = "<|im_start|>system\nI\n\nD<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert turn.prompt_ids == model.tokenizer.encode(expected, add_special_tokens=True)
    assert turn.response_id.startswith("resp_") and len(turn.response_id) == len("resp_") + 16


def test_a_previous_turn_comes_back_without_its_system_messages(model: SimModel) -> None:
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q1"}]
    output = [{"type": "message", "content": [{"text": "a1"}]}]
    body = {"instructions": "new", "input": "q2"}
    assert responses.input_messages(body, history, output) == [
        {"role": "system", "content": "new"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]


def test_without_the_store_every_previous_response_is_unknown(model: SimModel) -> None:
    api = responses.ResponsesApi(model, MAX_MODEL_LEN, 16, store=False)
    with pytest.raises(EngineError) as missing:
        api.turn({"input": "x", "previous_response_id": "resp_1"})
    assert missing.value.body() == {"error": {"message": "Response with id 'resp_1' not found.",
                                              "type": "invalid_request_error", "param": "response_id", "code": 404}}
    assert responses.store_enabled({"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    assert not responses.store_enabled({})


def test_a_response_streams_as_vllm_streams_it(model: SimModel) -> None:
    api = responses.ResponsesApi(model, MAX_MODEL_LEN, 16, store=True)
    body = {"input": "hello", "max_output_tokens": 1, "stream": True}
    turn = api.turn(body)
    answer = api.answer(body, turn)
    req = sim_request(model, len(turn.prompt_ids), 0, 1)
    stream = answer.opening() + answer.first(req) + answer.token(req, req.output[0], True) + answer.closing(req)
    raw = events(stream)
    item, text = answer.item_id, json.dumps(model.token_text[req.output[0]], ensure_ascii=False)
    part = '{"annotations":[],"text":%s,"type":"output_text","logprobs":null}' % text
    assert raw[2:5] == [
        ("response.output_item.added", '{"item":{"id":"%s","content":[],"role":"assistant","status":"in_progress",'
                                       '"type":"message","phase":null},"output_index":0,"sequence_number":2,'
                                       '"type":"response.output_item.added"}' % item),
        ("response.content_part.added", '{"content_index":0,"item_id":"%s","output_index":0,"part":{"annotations":[],'
                                        '"text":"","type":"output_text","logprobs":[]},"sequence_number":3,'
                                        '"type":"response.content_part.added"}' % item),
        ("response.output_text.delta", '{"content_index":0,"delta":%s,"item_id":"%s","logprobs":[],"output_index":0,'
                                       '"sequence_number":4,"type":"response.output_text.delta"}' % (text, item)),
    ]
    assert raw[5:8] == [
        ("response.output_text.done", '{"content_index":0,"item_id":"%s","logprobs":[],"output_index":0,'
                                      '"sequence_number":5,"text":%s,'
                                      '"type":"response.output_text.done"}' % (item, text)),
        ("response.content_part.done", '{"content_index":0,"item_id":"%s","output_index":0,"part":%s,'
                                       '"sequence_number":6,"type":"response.content_part.done"}' % (item, part)),
        ("response.output_item.done", '{"item":{"id":"%s","content":[%s],"role":"assistant","status":"completed",'
                                      '"type":"message","phase":null},"output_index":0,"sequence_number":7,'
                                      '"type":"response.output_item.done"}' % (item, part)),
    ]
    seen = [(name, json.loads(data)) for name, data in raw]
    assert [name for name, _ in seen] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in seen] == list(range(9))
    assert all(list(data) == sorted(data) for _, data in seen)
    created, completed = seen[0][1]["response"], seen[-1][1]["response"]
    assert created["status"] == "in_progress" and created["usage"] is None and created["output"] == []
    assert completed["status"] == "incomplete" and completed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert completed["usage"]["input_tokens"] == len(turn.prompt_ids)
    assert completed["output"][0]["id"] == seen[2][1]["item"]["id"]
    assert api.get(turn.response_id) == completed
    with pytest.raises(EngineError, match="Cannot cancel a synchronous response."):
        api.cancel(turn.response_id)


def test_a_function_tool_is_echoed_with_every_field() -> None:
    tool = {"type": "function", "name": "get", "parameters": {"type": "object"}}
    responses.check_request({"input": "x", "tools": [tool]})
    assert list(responses._echoed_tool(tool)) == ["name", "parameters", "strict", "type", "allowed_callers", "async",
                                                  "defer_loading", "description", "output_schema"]


def test_tool_choice_rules_without_and_with_tools() -> None:
    with pytest.raises(EngineError, match="Tool choice 'required' must be specified"):
        responses.check_request({"input": "x", "tool_choice": "required"})
    ns = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "inner"}]}
    assert responses.resolved_tool_choice({"type": "function", "name": "inner"}, [ns]) == {
        "name": "ns__inner", "type": "function"}
    assert responses.resolved_tool_choice("auto", []) == "none"


def test_routes_answer_as_fastapi() -> None:
    async def handler(*args: Any) -> Any:
        return args

    routes = [Route("POST", "/v1/responses", handler), Route("GET", "/v1/responses/{response_id}", handler),
              Route("POST", "/v1/responses/{response_id}/cancel", handler)]
    assert match(routes, "GET", "/v1/responses/resp_1").params == ["resp_1"]
    assert match(routes, "DELETE", "/v1/responses/resp_1").refusal == (
        {"detail": "Method Not Allowed"}, 405, {"Allow": "GET"})
    assert match(routes, "GET", "/v1/responses").refusal == ({"detail": "Method Not Allowed"}, 405, {"Allow": "POST"})
    assert match(routes, "GET", "/v1/responses/").refusal == ({"detail": "Not Found"}, 404, {})


def test_request_fields_beat_the_template_kwargs() -> None:
    conversation = Conversation([], chat_template_kwargs={"add_generation_prompt": False, "x": 1},
                                reasoning_effort="none")
    assert conversation.template_kwargs() == {"add_generation_prompt": True, "x": 1, "continue_final_message": False,
                                              "reasoning_effort": "none", "enable_thinking": False}
    mine = Conversation([], chat_template_kwargs={"enable_thinking": True}, reasoning_effort="none")
    assert mine.template_kwargs()["enable_thinking"] is True
