"""Nothing large on the loop: big chat bodies render and tokenize on a worker, a prompt that can only be refused for
its length is refused before it is tokenized, client ids are bounded, and the HTTP event ingest is bounded in bytes
and blocks and decodes off the loop. Each hostile request runs while a probe checks that ``/health`` keeps being
answered within 50 ms (:func:`without_blocking_the_loop`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kvgate.loadgen.sim.wire import BlockStored, KVEventBatch
from tests.abuse.support import assert_openai_error, gateway_config, without_blocking_the_loop
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
EVENTS_TOKEN = "events-token-for-loop-bounds"
EVENTS = {"authorization": f"Bearer {EVENTS_TOKEN}"}
MAX_MODEL_LEN = 200_000


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loop-bounds")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 1, "--time-scale", "0", "--max-model-len", str(MAX_MODEL_LEN), "--kv-blocks", "20000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "k.yaml", server={"events_token": EVENTS_TOKEN}))
    yield g
    g.stop()


def post(gw: Gateway, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return httpx.post(gw.url + path, content=raw, headers={"content-type": "application/json", **(headers or {})},
                      timeout=60)


def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Does thing {i}.",
                                              "parameters": {"type": "object"}}} for i in range(count)]


def test_thousands_of_tools_render_off_the_loop(gw: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools(1500), "max_tokens": 1}
    response = without_blocking_the_loop(gw.url, lambda: post(gw, "/kvgate/v1/explain", body))
    assert response.status_code == 200, response.text[:300]
    assert response.json()["tokenizer"] == "local"
    # 10,000 tools (30,000 objects, within the bound) render to more tokens than the model takes: counted exactly,
    # so rendered and tokenized in full, on a worker (on the loop they held it for a third of a second)
    body["tools"] = tools(10_000)
    response = without_blocking_the_loop(gw.url, lambda: post(gw, "/kvgate/v1/explain", body))
    error = assert_openai_error(response, 400, "context_length_exceeded")
    assert "at least" not in error["message"]


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools(20_000)},  # held it 363 ms
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "p"}] * 60_000}]},  # 193 ms
], ids=["20k-tools", "60k-content-parts"])
def test_tens_of_thousands_of_objects_are_refused_before_decoding(gw: Gateway, body: dict) -> None:
    response = without_blocking_the_loop(gw.url, lambda: post(gw, "/v1/chat/completions", body))
    assert_openai_error(response, 413, "request_too_complex")


def test_thousands_of_content_parts_render_off_the_loop(gw: Gateway) -> None:
    parts = [{"type": "text", "text": "p"} for _ in range(32_000)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    response = without_blocking_the_loop(gw.url, lambda: post(gw, "/kvgate/v1/explain", body))
    assert response.status_code == 200, response.text[:300]
    assert response.json()["prompt_tokens"] >= 30_000


def test_a_prompt_too_long_for_the_model_is_refused_before_it_is_tokenized(gw: Gateway) -> None:
    text = "word " * 700_000  # 3.5 MB, at least 218,750 tokens: seconds of tokenizer CPU before the context-length 400
    started = time.monotonic()
    response = without_blocking_the_loop(
        gw.url, lambda: post(gw, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}))
    error = assert_openai_error(response, 400, "context_length_exceeded")
    assert "at least" in error["message"]
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("header", ["x-session-id", "x-request-id"])
def test_client_ids_are_bounded(gw: Gateway, header: str) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    response = post(gw, "/v1/completions", body, {header: "s" * 60_000})
    assert assert_openai_error(response, 400, "invalid_header")["param"] == header
    assert post(gw, "/v1/completions", body, {header: "s" * 200}).status_code == 200


def event_batch(events: int, block_size: int = 16) -> bytes:
    stored = [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[1] * block_size, block_size=block_size,
                          lora_id=None, medium="GPU", lora_name=None) for i in range(events)]
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=stored))


def post_events(gw: Gateway, payload: bytes, seq: int) -> httpx.Response:
    headers = {**EVENTS, "content-type": "application/msgpack", "x-kvgate-replica": "sim-0", "x-kvgate-seq": str(seq)}
    return httpx.post(gw.url + "/kvgate/v1/events", content=payload, headers=headers, timeout=60)


def test_a_huge_event_post_is_refused_without_blocking_the_loop(gw: Gateway) -> None:
    payload = event_batch(250_000, block_size=1)  # 28 MB: decoding and applying it held the loop for seconds
    response = without_blocking_the_loop(gw.url, lambda: post_events(gw, payload, 0))
    assert_openai_error(response, 413, "request_too_large")


def test_an_event_post_with_too_many_blocks_is_refused_without_blocking_the_loop(gw: Gateway) -> None:
    payload = event_batch(6000)  # under a megabyte, over the 4,096 blocks a post may hold
    response = without_blocking_the_loop(gw.url, lambda: post_events(gw, payload, 0))
    assert "blocks" in assert_openai_error(response, 413, "request_too_large")["message"]
    assert post_events(gw, event_batch(100), 0).json()["status"] == "applied"


def test_a_deeply_nested_json_event_batch_is_a_400(gw: Gateway) -> None:
    raw = b'{"replica": "sim-0", "seq": 0, "batch": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    response = httpx.post(gw.url + "/kvgate/v1/events", content=raw,
                          headers={**EVENTS, "content-type": "application/json"}, timeout=10)
    assert response.status_code in (200, 400), response.text  # a malformed frame in sequence, or a bad body
    assert response.status_code != 500
    json.loads(response.text)
