"""A real ``kvgate sim`` process through the official clients of its agentic APIs: the ``anthropic`` SDK on
``/v1/messages`` (and count_tokens) and the ``openai`` SDK on ``/v1/responses``, streamed and not, multi-turn with
tool use, the Responses store behind ``previous_response_id`` (``VLLM_ENABLE_RESPONSES_API_STORE=1``), the prefix
cache seen through each API's usage, and prompts counted as the chat endpoint counts the same conversation."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import anthropic
import httpx
import openai
import pytest

from tests.support import Sim, start_sim, wait_until, wait_until_async

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
BLOCK = 16
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                                "parameters": TOOLS[0]["input_schema"]}}]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # the sim reads vLLM's own switch at start
        s = start_sim(tmp_path_factory.mktemp("sim-agentic"), 2, "--time-scale", "0.01")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(sim: Sim) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=sim.url(0), api_key="unused", timeout=10.0, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(sim: Sim) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=sim.url(0) + "/v1", api_key="unused", timeout=10.0, max_retries=0)
    yield c
    c.close()


def unique(words: int = 120) -> str:
    """A prompt no other test shares (its first token differs), long enough to fill blocks."""
    return f"{uuid.uuid4()} " + " ".join(f"line{i} of the repository" for i in range(words))


def chat_prompt_tokens(sim: Sim, messages: list[dict[str, Any]], **extra: Any) -> int:
    """What the sim's chat completions counts for the same conversation."""
    r = httpx.post(sim.url(0) + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def records(sim: Sim, replica: int = 0) -> list[dict[str, Any]]:
    return httpx.get(sim.url(replica) + "/sim/requests", params={"limit": 500}, timeout=5).json()["requests"]


def test_a_message_and_its_stream_through_the_anthropic_sdk(claude: anthropic.Anthropic, sim: Sim) -> None:
    system = [{"type": "text", "text": unique()}, {"type": "text", "text": "Be brief.",
                                                   "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello",
                                              "cache_control": {"type": "ephemeral"}}]}]
    message = claude.messages.create(model=MODEL, max_tokens=6, system=system, messages=messages,  # type: ignore[arg-type]
                                     extra_headers={"X-Request-Id": "claude-plain"})
    assert message.id == "chatcmpl-claude-plain" and message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text" and message.content[0].text
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    chat = [{"role": "system", "content": system[0]["text"] + "Be brief."}, {"role": "user", "content": "hello"}]
    assert prompt == chat_prompt_tokens(sim, chat) and usage.output_tokens == 6
    assert usage.cache_creation_input_tokens == prompt // BLOCK * BLOCK and usage.cache_read_input_tokens == 0

    with claude.messages.stream(model=MODEL, max_tokens=5, system=system, messages=messages) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" not in kinds
    assert kinds.count("content_block_delta") == 5 and kinds.count("message_delta") == 1
    assert final.usage.cache_read_input_tokens == (prompt - 1) // BLOCK * BLOCK  # the repeated prefix was cached
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        + (final.usage.cache_creation_input_tokens or 0) == prompt
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens == prompt  # type: ignore[arg-type]


def test_a_tool_use_turn_renders_as_the_same_chat(claude: anthropic.Anthropic, sim: Sim) -> None:
    task = unique()
    first = claude.messages.create(model=MODEL, max_tokens=4, tools=TOOLS, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": task}])
    turns = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text},  # type: ignore[union-attr]
                                          {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
                                     {"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}]},
    ]
    second = claude.messages.create(model=MODEL, max_tokens=3, tools=TOOLS, messages=turns)  # type: ignore[arg-type]
    chat = [{"role": "user", "content": task},
            {"role": "assistant", "content": first.content[0].text,  # type: ignore[union-attr]
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"}, {"role": "user", "content": "fix it"}]
    prompt = chat_prompt_tokens(sim, chat, tools=CHAT_TOOLS)
    usage = second.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) \
        + (usage.cache_creation_input_tokens or 0) == prompt
    assert (usage.cache_read_input_tokens or 0) >= first.usage.cache_creation_input_tokens  # type: ignore[operator]
    assert claude.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turns).input_tokens == prompt  # type: ignore[arg-type]


def test_messages_errors_as_vllm_answers_them(claude: anthropic.Anthropic, sim: Sim) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="other", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": f"The model `other` does not exist. Valid aliases: {MODEL}."}}
    r = httpx.post(sim.url(0) + "/v1/messages", json={"model": MODEL, "messages": []}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"  # the request model's, OpenAI-shaped
    assert r.json()["error"]["param"] == "body.max_tokens"


def test_a_response_and_its_stream_through_the_openai_sdk(client: openai.OpenAI, sim: Sim) -> None:
    question = unique()
    response = client.responses.create(model=MODEL, instructions="You are terse.", input=question,
                                       max_output_tokens=5, store=False)
    assert response.id.startswith("resp_") and response.status == "incomplete" and response.output_text
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}]
    assert response.usage is not None and response.usage.input_tokens == chat_prompt_tokens(sim, chat)
    assert response.usage.input_tokens_details.cached_tokens == 0

    events = list(client.responses.create(model=MODEL, instructions="You are terse.", input=question,
                                          max_output_tokens=4, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 4
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.input_tokens == response.usage.input_tokens
    assert done.usage.input_tokens_details.cached_tokens == (done.usage.input_tokens - 1) // BLOCK * BLOCK


def test_a_stored_response_is_the_next_turns_history(client: openai.OpenAI, sim: Sim) -> None:
    question = unique()
    first = client.responses.create(model=MODEL, instructions="Rules.", input=question, max_output_tokens=6)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = client.responses.create(model=MODEL, instructions="Rules.", previous_response_id=first.id,
                                     input="and then?", max_output_tokens=2, store=False)
    assert follow.previous_response_id == first.id
    # the stored turn's instructions do not carry over: this turn's come first, then its history
    history = [{"role": "system", "content": "Rules."}, {"role": "user", "content": question},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "and then?"}]
    assert follow.usage is not None and follow.usage.input_tokens == chat_prompt_tokens(sim, history)
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError):  # not stored: store=False
        client.responses.create(model=MODEL, previous_response_id=follow.id, input="x", max_output_tokens=1)
    deleted = httpx.delete(sim.url(0) + f"/v1/responses/{first.id}", timeout=5)
    assert deleted.status_code == 405 and deleted.json() == {"detail": "Method Not Allowed"}
    assert deleted.headers["allow"] == "GET"
    other_replica = httpx.get(sim.url(1) + f"/v1/responses/{first.id}", timeout=5)
    assert other_replica.status_code == 404  # each replica is its own engine process with its own store


def test_a_restart_forgets_the_stored_responses(sim: Sim) -> None:
    with openai.OpenAI(base_url=sim.url(1) + "/v1", api_key="unused", timeout=10.0, max_retries=0) as c:
        stored = c.responses.create(model=MODEL, input="x", max_output_tokens=1)
        assert c.responses.retrieve(stored.id).id == stored.id
        assert httpx.post(sim.url(1) + "/sim/fault", json={"action": "restart"}, timeout=5).status_code == 200
        with pytest.raises(openai.NotFoundError):  # the store lived in the engine process
            c.responses.retrieve(stored.id)


def test_records_name_the_api_and_claude_codes_session(claude: anthropic.Anthropic, client: openai.OpenAI,
                                                      sim: Sim) -> None:
    claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                           extra_headers={"X-Request-Id": "rec-messages", "x-claude-code-session-id": "sess-1"})
    client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False,
                            extra_headers={"X-Request-Id": "rec-responses"})
    seen = {e["headers"]["x-request-id"]: e for e in records(sim)}
    assert seen["rec-messages"]["endpoint"] == "/v1/messages"
    assert seen["rec-messages"]["headers"]["x-claude-code-session-id"] == "sess-1"
    assert seen["rec-responses"]["endpoint"] == "/v1/responses"


async def test_the_first_event_comes_with_the_first_token(sim: Sim) -> None:
    """With the engine stalled, a Responses stream has already sent ``response.created`` (vLLM sends it on
    acceptance), a Messages stream sent nothing yet: its ``message_start`` comes with the first token."""
    fault = {"action": "stall"}
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": unique(10)}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        assert (await http.post(sim.url(1) + "/sim/fault", json=fault)).status == 200
        try:
            messages = await http.post(sim.url(1) + "/v1/messages", json=body)
            assert messages.status == 200  # the headers: the request is in the engine's queue
            responses = await http.post(sim.url(1) + "/v1/responses", json={
                "model": MODEL, "input": unique(10), "max_output_tokens": 2, "stream": True, "store": False})
            opening = await asyncio.wait_for(responses.content.readuntil(b"\n\n"), 5)
            assert opening.startswith(b"event: response.created\n")
            assert messages.content.total_bytes == 0
        finally:
            assert (await http.post(sim.url(1) + "/sim/fault", json={"action": "unstall"})).status == 200
        first = await asyncio.wait_for(messages.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"event: message_start\n")
        rest = (await asyncio.wait_for(messages.content.read(), 5)).decode()
        assert rest.count("event: content_block_delta") == 2 and rest.endswith('data: {"type":"message_stop"}\n\n')
        await responses.content.read()

    async def both_finished() -> bool:
        async with httpx.AsyncClient(timeout=5) as c:
            entries = (await c.get(sim.url(1) + "/sim/requests", params={"limit": 500})).json()["requests"]
        return sum(e["endpoint"] in ("/v1/messages", "/v1/responses") and e["status"] == "completed"
                   for e in entries) >= 2

    await wait_until_async(both_finished, "both streams' requests to complete", timeout=5.0)


def test_the_sim_reads_the_store_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)  # vLLM's default: no store
    off = start_sim(tmp_path, 1, "--time-scale", "0")
    try:
        with openai.OpenAI(base_url=off.url(0) + "/v1", api_key="unused", timeout=10.0, max_retries=0) as c:
            stored = c.responses.create(model=MODEL, input="x", max_output_tokens=1)  # store defaults to true
            with pytest.raises(openai.NotFoundError, match=f"Response with id '{stored.id}' not found."):
                c.responses.retrieve(stored.id)
    finally:
        off.stop()


def test_a_disconnected_message_stream_aborts_its_request(sim: Sim) -> None:
    body = {"model": MODEL, "max_tokens": 5000, "stream": True, "messages": [{"role": "user", "content": "long"}]}
    with httpx.Client(timeout=5) as c:
        with c.stream("POST", sim.url(0) + "/v1/messages", json=body, headers={"X-Request-Id": "claude-gone"}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and json.loads(line[5:])["type"] == "content_block_delta":
                    break  # the first text arrived: hang up mid-stream
    wait_until(lambda: {e["headers"]["x-request-id"]: e["status"] for e in records(sim)}.get("claude-gone")
               == "aborted", "the hung-up request to be aborted", timeout=5.0)
