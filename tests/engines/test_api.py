"""The OpenAI API through kvgate to real vLLM replicas, with the official client, streaming and not."""

from __future__ import annotations

from openai import OpenAI

from kvgate.loadgen.engines import MODEL_NAME
from tests.engines.conftest import chat, unique_text
from tests.support import Gateway


def client(gw: Gateway) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def test_models_lists_the_engines_model(kvgate: Gateway) -> None:
    assert MODEL_NAME in [m.id for m in client(kvgate).models.list().data]


def test_chat_and_completions_non_streaming(kvgate: Gateway, replicas: list) -> None:
    names = {r.name for r in replicas}
    raw = client(kvgate).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=chat(unique_text(200)), max_tokens=8)
    reply = raw.parse()
    assert raw.headers["x-kvgate-replica"] in names
    assert raw.headers["x-kvgate-decision"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.usage.prompt_tokens_details is not None  # the engines run with --enable-prompt-tokens-details

    raw = client(kvgate).completions.with_raw_response.create(model=MODEL_NAME, prompt=unique_text(200), max_tokens=8)
    done = raw.parse()
    assert raw.headers["x-kvgate-replica"] in names
    assert done.choices[0].text is not None and done.usage is not None and done.usage.completion_tokens > 0


def test_chat_and_completions_streaming(kvgate: Gateway) -> None:
    api = client(kvgate)
    chunks = list(api.chat.completions.create(model=MODEL_NAME, messages=chat(unique_text(200)), max_tokens=8,
                                              stream=True, stream_options={"include_usage": True}))
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0

    chunks = list(api.completions.create(model=MODEL_NAME, prompt=unique_text(200), max_tokens=8, stream=True,
                                         stream_options={"include_usage": True}))
    assert any(c.choices and c.choices[0].text for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
