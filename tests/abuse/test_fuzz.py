"""Property-based fuzzing (Hypothesis) of what clients and the network send: request parsing answers with an
ApiError or PromptError (a 4xx), never anything else; event decoding raises nothing but its own MalformedBatch."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvgate.cache_index.events import DecodedBatch, MalformedBatch, decode_batch, decode_batch_object
from kvgate.router.apis.anthropic import COUNT_TOKENS, MESSAGES
from kvgate.router.apis.base import Api
from kvgate.router.apis.openai import CHAT, COMPLETIONS
from kvgate.router.apis.responses import RESPONSES
from kvgate.router.core.config import LimitsConfig
from kvgate.router.core.errors import ApiError
from kvgate.router.pipeline.bodies import client_salt, parse_body, refuse_engine_steering, required_model, wants_stream
from kvgate.router.prompts.prompt import PromptError, check_limits


def decode_json_batch(body: bytes) -> DecodedBatch:
    """A batch sent as JSON text, as the HTTP ingest decodes one (``kvgate.cache_index.http_ingest``)."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise MalformedBatch(f"not JSON: {exc}") from exc
    return decode_batch_object(raw)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
chat_keys = st.sampled_from(["model", "messages", "role", "content", "type", "text", "stream", "cache_salt",
                             "kv_transfer_params", "vllm_xargs", "bootstrap_room",
                             "chat_template", "chat_template_kwargs", "tools", "documents", "prompt",
                             "add_generation_prompt", "continue_final_message", "add_special_tokens",
                             "system", "max_tokens", "tool_use", "tool_result", "tool_use_id", "id", "name", "input",
                             "input_schema", "cache_control", "thinking", "image", "source", "tool_choice",
                             "instructions", "function_call", "function_call_output", "call_id", "output",
                             "arguments", "reasoning", "summary", "input_text", "output_text",
                             "max_output_tokens", "previous_response_id", "store", "metadata"])
request_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(chat_keys, inner, max_size=6),
    max_leaves=40,
)


APIS: dict[str, Api] = {api.name: api for api in (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)}
endpoints = st.sampled_from(sorted(APIS))


def parse_request(raw: bytes, endpoint: str) -> None:
    """What the gateway does with a body before routing, in order."""
    api = APIS[endpoint]
    body = parse_body(raw)
    refuse_engine_steering(body)
    required_model(body)
    wants_stream(body)
    client_salt(body)
    api.session_of(body)
    api.max_tokens(body)
    check_limits(api.prompt(body), LimitsConfig())


@FUZZ
@given(raw=st.binary(max_size=300), endpoint=endpoints)
def test_arbitrary_bytes_are_a_client_error(raw: bytes, endpoint: str) -> None:
    try:
        parse_request(raw, endpoint)
    except (ApiError, PromptError):
        pass


@FUZZ
@given(body=st.one_of(json_values, request_like), endpoint=endpoints)
def test_arbitrary_json_is_accepted_or_a_client_error(body: Any, endpoint: str) -> None:
    try:
        parse_request(msgspec.json.encode(body), endpoint)
    except ApiError as e:
        assert 400 <= e.status < 500
    except PromptError:
        pass


@FUZZ
@given(depth=st.integers(min_value=1, max_value=200_000), opener=st.sampled_from([b"[", b'{"a":']), endpoint=endpoints)
def test_any_nesting_depth_is_a_client_error(depth: int, opener: bytes, endpoint: str) -> None:
    closer = b"]" if opener == b"[" else b"}"
    field = b"input" if endpoint == "responses" else b"prompt" if endpoint == "completions" else b"messages"
    try:
        parse_request(b'{"model":"m","' + field + b'":' + opener * depth + b"1" + closer * depth + b"}", endpoint)
    except (ApiError, PromptError):
        pass


@FUZZ
@given(payload=st.one_of(st.binary(max_size=300), json_values.map(msgspec.msgpack.encode)))
def test_event_decoding_raises_only_malformed_batch(payload: bytes) -> None:
    try:
        decode_batch(payload)
    except MalformedBatch:
        pass


@FUZZ
@given(payload=st.one_of(st.binary(max_size=300), json_values.map(msgspec.json.encode)))
def test_json_event_decoding_raises_only_malformed_batch(payload: bytes) -> None:
    try:
        decode_json_batch(payload)
    except MalformedBatch:
        pass


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deep_event_payloads_raise_only_malformed_batch(depth: int) -> None:
    for payload in (b"\x91" * depth + b"\x00", b"[" * depth + b"]" * depth):
        try:
            decode_batch(payload) if payload[0] == 0x91 else decode_json_batch(payload)
        except MalformedBatch:
            pass


block_types = st.sampled_from(["text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                               "redacted_thinking", "document", "server_tool_use", "input_text", "output_text",
                               "input_image", "message", "function_call", "function_call_output", "reasoning",
                               "item_reference", "bogus"])
block_fields = st.dictionaries(st.sampled_from(["text", "id", "name", "input", "content", "tool_use_id", "source",
                                                "thinking", "signature", "data", "cache_control", "is_error",
                                                "call_id", "arguments", "output", "role", "summary", "image_url",
                                                "tool_name", "status"]),
                               request_like, max_size=4)
blocks = st.builds(lambda kind, fields: {"type": kind, **fields}, block_types, block_fields)
contents = st.one_of(st.text(max_size=20), st.lists(st.one_of(blocks, request_like), max_size=4), request_like)
turns = st.builds(lambda role, content: {"role": role, "content": content},
                  st.sampled_from(["user", "assistant"] * 4 + ["system", "developer", "tool", "bogus"]), contents)
messages_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(turns, max_size=5)},
    optional={"max_tokens": st.one_of(st.integers(-5, 10**12), request_like), "system": contents,
              "tools": st.lists(st.one_of(block_fields, request_like), max_size=3),
              "stream": st.one_of(st.booleans(), request_like),
              "thinking": request_like, "tool_choice": request_like, "stop_sequences": request_like},
)
responses_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.one_of(st.text(max_size=20), st.lists(st.one_of(blocks, turns), max_size=5))},
    optional={"instructions": contents, "max_output_tokens": st.one_of(st.integers(-5, 10**12), request_like),
              "tools": st.lists(st.one_of(block_fields, request_like), max_size=3), "reasoning": request_like,
              "previous_response_id": request_like, "store": request_like, "text": request_like},
)


@FUZZ
@given(body=st.one_of(messages_bodies.map(lambda b: ("messages", b)), messages_bodies.map(lambda b: ("count_tokens", b)),
                      responses_bodies.map(lambda b: ("responses", b))))
@example(body=("messages", {"model": "m", "messages": [{"role": "user", "content": [{"type": []}]}]}))
@example(body=("responses", {"model": "m", "input": [{"role": "user", "content": [{"type": []}]}]}))
@example(body=("messages", {"model": "m", "messages": [{"role": ["user"], "content": "x"}], "tool_choice": {"type": {}},
                            "output_config": {"effort": []}}))
def test_agent_api_bodies_are_accepted_or_a_client_error(body: tuple[str, dict[str, Any]]) -> None:
    """Bodies shaped like the agents' APIs, deep enough to reach the conversion to vLLM's conversation."""
    endpoint, fields = body
    try:
        parse_request(msgspec.json.encode(fields), endpoint)
    except ApiError as e:
        assert 400 <= e.status < 500
    except PromptError:
        pass
