"""Small hostile requests against `kvgate serve` on a real `kvgate sim`: each gets an OpenAI-style 4xx before anything
is forwarded, and none holds the gateway's event loop (a /health probe keeps being answered within 50 ms)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.abuse.support import assert_openai_error, gateway_config, without_blocking_the_loop
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{{ 'x' * 10000000 }}"
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("abuse-shape")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 1, "--time-scale", "0", "--max-model-len", "2048", "--kv-blocks", "4096")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "default.yaml"))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def trusting_gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    """Trusts request templates, with a short render time limit."""
    limits = {"trust_request_chat_template": True, "request_template_timeout_s": 0.5}
    g = start_kvgate(workdir, gateway_config(sim, workdir, "trusting.yaml", limits=limits))
    yield g
    g.stop()


def post_chat(gw: Gateway, body: dict | bytes, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gw.url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def sim_request_count(sim: Sim) -> int:
    return len(httpx.get(sim.url(0) + "/sim/requests?limit=100000", timeout=5).json()["requests"])


def test_request_chat_templates_are_refused_unless_trusted(gw: Gateway, sim: Sim) -> None:
    before = sim_request_count(sim)
    for body in (
        {"model": MODEL, "messages": USER, "chat_template": NESTED_LOOPS},
        {"model": MODEL, "messages": USER, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}},
    ):
        response = without_blocking_the_loop(gw.url, lambda: post_chat(gw, body))
        error = assert_openai_error(response, 400, "untrusted_chat_template")
        assert "trust-request-chat-template" in error["message"]
    assert sim_request_count(sim) == before  # nothing was forwarded
    # Template arguments are still passed (they only reach variables the template reads).
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert reply.choices[0].message.content is not None


def test_a_trusted_template_that_loops_is_stopped_by_its_time_limit(trusting_gw: Gateway) -> None:
    body = {"model": MODEL, "messages": USER, "chat_template": NESTED_LOOPS}
    response = without_blocking_the_loop(trusting_gw.url, lambda: post_chat(trusting_gw, body))
    error = assert_openai_error(response, 400)
    assert "did not render within" in error["message"] and error["param"] == "chat_template"
    # The renderer is replaced, and trusted templates keep working.
    ok = post_chat(trusting_gw, {"model": MODEL, "messages": USER, "max_tokens": 2,
                                 "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    assert ok.status_code == 200, ok.text


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_trusted_template_cannot_render_a_huge_prompt(trusting_gw: Gateway) -> None:
    """Jinja folds the constant while compiling (~0.4 s here), so the time limit or the size limit stops it; either
    way the gateway's own memory does not grow by the prompt (it grew by 374 MB when it rendered in-process)."""
    before = rss_bytes(trusting_gw.process.pid)
    body = {"model": MODEL, "messages": USER, "chat_template": HUGE_OUTPUT}
    response = without_blocking_the_loop(trusting_gw.url, lambda: post_chat(trusting_gw, body))
    error = assert_openai_error(response, 400)
    assert error["param"] == "chat_template"
    assert "the limit is" in error["message"] or "did not render within" in error["message"]
    assert rss_bytes(trusting_gw.process.pid) - before < 50 * 1024 * 1024


NESTING = 100_000


@pytest.mark.parametrize(
    "raw, status, code",
    [
        # tiny messages by the hundred thousand are refused before decoding
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 800_000}).encode(), 413,
         "request_too_complex"),
        (json.dumps({"model": MODEL, "messages": USER * 5000}).encode(), 400, "too_many_messages"),
        # deeply nested JSON is a 400, not a 500
        (b'{"model": "kvgate-sim", "messages": ' + b"[" * NESTING + b"]" * NESTING + b"}", 400, "invalid_json"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y" * 4_000_001}]}).encode(), 400,
         "prompt_too_long"),
    ],
    ids=["tiny-messages-by-the-hundred-thousand", "more-messages-than-the-limit", "deeply-nested-json",
         "prompt-text-over-the-character-limit"],
)
def test_an_oversized_chat_is_refused_without_blocking_the_loop(
    gw: Gateway, sim: Sim, raw: bytes, status: int, code: str
) -> None:
    before = sim_request_count(sim)
    response = without_blocking_the_loop(gw.url, lambda: post_chat(gw, raw))
    assert_openai_error(response, status, code)
    assert sim_request_count(sim) == before  # nothing was forwarded


def test_prompt_longer_than_the_models_context_gets_400(gw: Gateway, sim: Sim) -> None:
    """The sim reports max_model_len 2048 in /v1/models; the gateway refuses longer prompts without forwarding."""
    before = sim_request_count(sim)
    text = " ".join(f"word{i}" for i in range(3000))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert caught.value.code == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in caught.value.message
    assert sim_request_count(sim) == before
    short = client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=1)
    assert short.choices
