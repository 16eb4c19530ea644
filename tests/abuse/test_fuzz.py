"""Property-based fuzzing (Hypothesis) of what clients and the network send: request parsing answers with an
ApiError or PromptError (a 4xx), never anything else; event decoding raises nothing but its own MalformedBatch."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.cache_index.events import DecodedBatch, MalformedBatch, decode_batch, decode_batch_object
from kvgate.router.apis.openai import parse_chat, parse_completion
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
                             "add_generation_prompt", "continue_final_message", "add_special_tokens"])
request_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(chat_keys, inner, max_size=6),
    max_leaves=40,
)


def parse_request(raw: bytes, endpoint: str) -> None:
    """What the gateway does with a body before routing, in order."""
    body = parse_body(raw)
    refuse_engine_steering(body)
    required_model(body)
    wants_stream(body)
    client_salt(body)
    prompt = parse_completion(body) if endpoint == "completions" else parse_chat(body)
    check_limits(prompt, LimitsConfig())


@FUZZ
@given(raw=st.binary(max_size=300), endpoint=st.sampled_from(["chat", "completions"]))
def test_arbitrary_bytes_are_a_client_error(raw: bytes, endpoint: str) -> None:
    try:
        parse_request(raw, endpoint)
    except (ApiError, PromptError):
        pass


@FUZZ
@given(body=st.one_of(json_values, request_like), endpoint=st.sampled_from(["chat", "completions"]))
def test_arbitrary_json_is_accepted_or_a_client_error(body: Any, endpoint: str) -> None:
    try:
        parse_request(msgspec.json.encode(body), endpoint)
    except ApiError as e:
        assert 400 <= e.status < 500
    except PromptError:
        pass


@FUZZ
@given(depth=st.integers(min_value=1, max_value=200_000), opener=st.sampled_from([b"[", b'{"a":']))
def test_any_nesting_depth_is_a_client_error(depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    try:
        parse_request(b'{"model":"m","messages":' + opener * depth + b"1" + closer * depth + b"}", "chat")
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
