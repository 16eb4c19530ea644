"""A real ``kvgate sim`` process driven over HTTP: the official openai client, vLLM's bodies and errors, the prefix
cache seen through usage and /sim/requests, client disconnects, and the HTTP-level faults."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvgate.router.core.config import LimitsConfig
from kvgate.router.settings.schema import load_config
from tests.support import Sim, start_sim, wait_until_async
from tests.tokenizing import tokenize_body

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
DOC = " ".join(f"word{i} of the long shared document" for i in range(400))  # ~3,000 tokens


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim-api"), 3, "--time-scale", "0.01")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(sim: Sim) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=sim.url(0) + "/v1", api_key="unused", timeout=10.0, max_retries=0)
    yield c
    c.close()


def record(sim: Sim, replica: int, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
    """The /sim/requests entry of the request sent with ``X-Request-Id: request_id``, once it has ended."""
    deadline = time.monotonic() + timeout
    while True:
        entries = httpx.get(sim.url(replica) + "/sim/requests", params={"limit": 500}, timeout=2).json()["requests"]
        found = [e for e in entries if e["headers"]["x-request-id"] == request_id]
        if found and found[-1]["status"] != "running":
            return found[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished record for {request_id}: {found}")
        time.sleep(0.02)


def fault(sim: Sim, via: int, **body: Any) -> None:
    r = httpx.post(sim.url(via) + "/sim/fault", json=body, timeout=5)
    assert r.status_code == 200, r.text


def test_write_config_loads(sim: Sim) -> None:
    config = load_config(sim.config_path)
    assert [r.name for r in config.replicas] == ["sim-0", "sim-1", "sim-2"]
    assert config.replicas[1].url == sim.url(1) and config.replicas[1].kv_events == sim.events_endpoint(1)
    assert config.replicas[1].kv_replay == sim.replay_endpoint(1)
    assert config.models[0].name == MODEL and Path(config.models[0].tokenizer or "").is_absolute()
    assert config.transfer.connector == "nixl"


def test_openai_completions(client: openai.OpenAI) -> None:
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert c.choices[0].finish_reason == "length" and c.choices[0].text
    assert c.usage is not None and c.usage.completion_tokens == 5
    assert c.usage.prompt_tokens_details is not None and c.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert again.choices[0].text == c.choices[0].text  # deterministic
    pieces = list(client.completions.create(model=MODEL, prompt=[1000, 1001, 1002], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].choices == [] and pieces[-1].usage is not None and pieces[-1].usage.prompt_tokens == 3


def test_openai_chat(client: openai.OpenAI, sim: Sim) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,  # type: ignore
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    tokenized = httpx.post(sim.url(0) + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chunks[-1].usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])


def test_repeated_prompt_is_cached_and_faster(client: openai.OpenAI, sim: Sim) -> None:
    prompt = f"{uuid.uuid4()} {DOC}"
    ids = []
    for _ in range(2):
        rid = uuid.uuid4().hex
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_headers={"X-Request-Id": rid})
        ids.append(rid)
        last = r
    cached = last.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached > 2500 and cached % 16 == 0
    first, second = record(sim, 0, ids[0]), record(sim, 0, ids[1])
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == cached
    assert second["ttft_ms"] < first["ttft_ms"] - 50  # ~3,000 tokens x 0.035 ms no longer prefilled
    metrics = httpx.get(sim.url(0) + "/metrics").text
    hits = next(line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.rsplit(" ", 1)[1]) >= cached
    finished = next(line for line in metrics.splitlines() if line.startswith("vllm:request_success_total"))
    assert 'finished_reason="length"' in finished and float(finished.rsplit(" ", 1)[1]) >= 2


def test_cache_salt_separates_prefixes(client: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4()} {DOC}"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert same.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        ({"prompt": "hi"}, 400, "model"),
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"model": "nope", "prompt": 42}, 404, "model"),  # the model is checked first, as vLLM does
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": []}, 400, "prompt"),
        ({"model": MODEL, "prompt": 42}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, "a"]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
        ({"model": MODEL, "prompt": "hi", "cache_salt": "a/b"}, 400, "cache_salt"),
        ({"model": MODEL, "prompt": "hi", "cache_salt": "x" * 129}, 400, "cache_salt"),
        ({"model": MODEL, "prompt": "hi", "cache_salt": 5}, 400, "cache_salt"),
        ({"model": MODEL, "prompt": "hi", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"model": MODEL, "prompt": [5] * 70_000}, 400, "input_tokens"),
        ({"model": MODEL, "prompt": [4000] * 300_000}, 400, "input_tokens"),  # 1.5 MB: above aiohttp's default cap
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ([1, 2], 400, None),
    ],
)
def test_bad_completion_requests(sim: Sim, body: Any, status: int, param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(sim.url(1) + "/v1/completions", timeout=5, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL},
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": ["hi"]},
        {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ],
)
def test_bad_chat_requests(sim: Sim, body: dict[str, Any]) -> None:
    r = httpx.post(sim.url(1) + "/v1/chat/completions", json=body, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"cache_salt": "a@b"})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_request_id_echo_and_surface(sim: Sim) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    r = httpx.post(sim.url(1) + "/v1/completions", json=body, headers={"X-Request-Id": "abc-123", "X-Session-ID": "s1"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    assert record(sim, 1, "abc-123")["headers"]["x-session-id"] == "s1"
    assert httpx.post(sim.url(1) + "/v1/completions", json=body).headers["x-request-id"]
    models = httpx.get(sim.url(1) + "/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == MODEL and card["owned_by"] == "vllm"
    assert card["parent"] is None and card["root"] and card["max_model_len"] == 4096 * 16
    tok = httpx.post(sim.url(1) + "/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"} and tok["count"] == len(tok["tokens"]) > 0
    assert httpx.get(sim.url(1) + "/health").status_code == 200
    text = httpx.get(sim.url(1) + "/metrics").text
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                 "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{",
                 "vllm:external_prefix_cache_hits_total{"):
        assert name in text and 'model_name="kvgate-sim"' in text and 'engine="0"' in text
    assert 'block_size="16"' in text and 'num_gpu_blocks="4096"' in text and 'prefix_caching_hash_algo="sha256"' in text
    assert httpx.get(sim.url(1) + "/nope").status_code == 404


async def test_client_disconnect_aborts(sim: Sim) -> None:
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 60_000, "stream": True}
    async with httpx.AsyncClient(timeout=5) as c:
        async with c.stream("POST", sim.url(2) + "/v1/completions", json=body,
                            headers={"X-Request-Id": "gone-stream"}) as r:
            async for _ in r.aiter_bytes():
                break  # first chunk received: hang up mid-stream
        task = asyncio.create_task(c.post(sim.url(2) + "/v1/completions", headers={"X-Request-Id": "gone-plain"},
                                          json={**body, "stream": False}))

        async def plain_reached_the_replica() -> bool:
            entries = (await c.get(sim.url(2) + "/sim/requests", params={"limit": 500})).json()["requests"]
            return any(e["headers"]["x-request-id"] == "gone-plain" for e in entries)

        await wait_until_async(plain_reached_the_replica, "the plain request on the replica", timeout=5.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert record(sim, 2, "gone-stream")["status"] == "aborted"
    assert record(sim, 2, "gone-plain")["status"] == "aborted"
    stats = httpx.get(sim.url(2) + "/sim/stats").json()
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0


def test_health_stall_stop_start(sim: Sim) -> None:
    fault(sim, 2, action="unhealthy")
    assert httpx.get(sim.url(2) + "/health").status_code == 503
    fault(sim, 2, action="healthy")
    assert httpx.get(sim.url(2) + "/health").status_code == 200
    fault(sim, 2, action="stall")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url(2) + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=0.5)
    fault(sim, 2, action="unstall")
    ok = httpx.post(sim.url(2) + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=5)
    assert ok.status_code == 200
    with httpx.Client(timeout=5) as c:
        with c.stream("POST", sim.url(2) + "/v1/completions", headers={"X-Request-Id": "cut-by-stop"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 60_000, "stream": True}) as r:
            fault(sim, 0, action="stop", replica=2)  # sim-wide: any replica's port reaches the others
            with pytest.raises(httpx.HTTPError):
                for _ in r.iter_bytes():
                    pass
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url(2) + "/health", timeout=2)
    fault(sim, 0, action="start", replica=2)
    assert httpx.get(sim.url(2) + "/health", timeout=2).status_code == 200
    assert record(sim, 2, "cut-by-stop")["status"] == "aborted"
    fault(sim, 2, action="stop")  # a replica can stop itself: the answer goes out first
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url(2) + "/health", timeout=2)
    fault(sim, 1, action="start", replica="sim-2")
    bad = httpx.post(sim.url(2) + "/sim/fault", json={"action": "explode"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "action"


def test_restart_cuts_inflight_and_forgets_cache(sim: Sim, client: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4()} {DOC}"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    httpx.post(sim.url(2) + "/v1/completions", json=body, timeout=5)
    fault(sim, 2, action="stall")
    with httpx.Client(timeout=5) as c:
        with c.stream("POST", sim.url(2) + "/v1/completions", json={**body, "stream": True, "max_tokens": 5},
                      headers={"X-Request-Id": "cut-by-restart"}) as r:
            fault(sim, 2, action="restart")
            with pytest.raises(httpx.HTTPError):
                for _ in r.iter_bytes():
                    pass
    assert record(sim, 2, "cut-by-restart")["status"] == "aborted"  # and the restarted engine is no longer stalled
    again = httpx.post(sim.url(2) + "/v1/completions", json=body, timeout=5).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def metric(text: str, name: str) -> float:
    """The value of the first sample of ``name`` (with or without labels) on a /metrics page."""
    line = next(line for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)
    return float(line.rsplit(" ", 1)[1])


def test_metric_names_are_the_real_engines(sim: Sim) -> None:
    # The names a real vLLM exported in the trial, and prometheus' standard process start time.
    prompt = f"{uuid.uuid4()} {DOC}"
    for _ in range(2):
        httpx.post(sim.url(1) + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=5)
    text = httpx.get(sim.url(1) + "/metrics", timeout=5).text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(text, name) >= 0, name
    assert metric(text, "vllm:prompt_tokens_cached_total") >= metric(text, "vllm:prefix_cache_hits_total") > 0
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="4096"' in info
    assert abs(metric(text, "process_start_time_seconds") - time.time()) < 3600


def test_a_restart_changes_the_process_start_time(sim: Sim) -> None:
    # A router can tell a restarted engine from one scrape (before any event or failed health check).
    before = metric(httpx.get(sim.url(2) + "/metrics", timeout=5).text, "process_start_time_seconds")
    fault(sim, 2, action="restart")
    after = metric(httpx.get(sim.url(2) + "/metrics", timeout=5).text, "process_start_time_seconds")
    assert after > before
    other = metric(httpx.get(sim.url(1) + "/metrics", timeout=5).text, "process_start_time_seconds")
    assert other < after, "each replica is its own engine process"


def test_second_chat_turn_hits_the_first_turns_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": f"{uuid.uuid4()} " + "You are a helpful assistant. " * 10},
                {"role": "user", "content": "Tell me a long story about the sea."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert first.usage is not None and second.usage is not None
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last sampled token has no KV
    assert second.usage.prompt_tokens_details.cached_tokens == computed // 16 * 16  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


CHAT_OPTION_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "partial ans"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "what is the weather"}],
     "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
     "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}{{ flavour | default('') }}",
     "chat_template_kwargs": {"flavour": "!!"}},
]


@pytest.mark.parametrize("body", CHAT_OPTION_BODIES)
async def test_chat_options_tokenize_as_kvgate_does(sim: Sim, body: dict[str, Any]) -> None:
    # The sim stands in for vLLM, so a chat prompt must become the same ids there as in kvgate's own tokenizer,
    # whatever template options the request carries: otherwise routing would look up blocks the engine never stores.
    from kvgate.loadgen.assets import TOKENIZER_DIR
    from kvgate.router.core.config import ModelConfig
    from kvgate.router.prompts.tokenizer import PromptTokenizer

    prompts = PromptTokenizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))],
                              limits=LimitsConfig(trust_request_chat_template=True))
    try:
        expected = (await tokenize_body(prompts, MODEL, "chat", body)).token_ids.tolist()
    finally:
        prompts.close()
    async with httpx.AsyncClient(timeout=5) as http:
        tokenized = (await http.post(sim.url(0) + "/tokenize", json={"model": MODEL, **body})).json()
        assert tokenized["tokens"] == expected
        completion = await http.post(sim.url(0) + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body})
    assert completion.status_code == 200
    assert completion.json()["usage"]["prompt_tokens"] == len(expected)


def test_chat_option_conflicts_are_400(sim: Sim) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}
    r = httpx.post(sim.url(0) + "/v1/chat/completions", json=body, timeout=5)  # add_generation_prompt defaults true
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(sim.url(0) + "/v1/chat/completions", json={**body, "continue_final_message": False, "tools": "x"}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_reset_prefix_cache_answers_as_vllm(sim: Sim) -> None:
    """vLLM's dev endpoint answers ``{"success": bool}``: false while a request holds blocks (nothing is forgotten),
    true once idle or with ``reset_running_requests=true`` (running requests are preempted and computed again)."""
    with httpx.Client(timeout=5) as c:
        with c.stream("POST", sim.url(1) + "/v1/completions", headers={"X-Request-Id": "held-by-reset"},
                      json={"model": MODEL, "prompt": DOC, "max_tokens": 60_000, "stream": True}) as r:
            chunks = r.iter_bytes()
            next(chunks)  # running, holding its blocks
            refused = c.post(sim.url(1) + "/reset_prefix_cache")
            assert refused.status_code == 200 and refused.json() == {"success": False}
            bad = c.post(sim.url(1) + "/reset_prefix_cache", params={"reset_running_requests": "maybe"})
            assert bad.status_code == 400
            forced = c.post(sim.url(1) + "/reset_prefix_cache", params={"reset_running_requests": "true"})
            assert forced.json() == {"success": True}
            next(chunks)  # preempted, not aborted: it goes on
    assert record(sim, 1, "held-by-reset")["status"] == "aborted"  # closed by this client
    assert httpx.post(sim.url(1) + "/reset_prefix_cache", timeout=5).json() == {"success": True}
