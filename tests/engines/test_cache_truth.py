"""kvgate's index against what real vLLM replicas hold: the block size it learns, the tokens it credits on every
request of a multi-turn workload, and evictions, checked against the engine's own replay buffer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from openai import OpenAI

from kvgate.loadgen.engines import BLOCK_SIZE, MODEL_NAME, VllmReplica
from tests.engines.conftest import (
    SMALL_CACHE_BLOCKS, chat, credited, rows, send_direct, settled_explain, tokenize, unique_text, wait_for,
)
from tests.engines.engine_state import replay_state
from tests.support import Gateway


@dataclass
class Turn:
    label: str
    replica: str
    credited: int
    engine_cached: int
    prompt_tokens: int


def send_checked(gw: Gateway, body: dict[str, Any], label: str, stream: bool) -> tuple[Turn, str]:
    """Explain ``body`` (settled), send it through kvgate, and pair what kvgate credited on the replica that served
    it with the engine's ``usage.prompt_tokens_details.cached_tokens``. Returns the pair and the reply's text."""
    before = rows(settled_explain(gw, body))
    api = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    create = api.chat.completions if "messages" in body else api.completions
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    raw = create.with_raw_response.create(model=MODEL_NAME, max_tokens=8, **body, **extra)
    replica = raw.headers["x-kvgate-replica"]
    reply = raw.parse()
    if stream:
        chunks = list(reply)
        usage = chunks[-1].usage
        text = "".join((c.choices[0].delta.content or "") if "messages" in body else (c.choices[0].text or "")
                       for c in chunks if c.choices)
    else:
        usage = reply.usage
        text = reply.choices[0].message.content if "messages" in body else reply.choices[0].text
    assert usage is not None and usage.prompt_tokens_details is not None
    turn = Turn(label, replica, credited(before[replica]), usage.prompt_tokens_details.cached_tokens or 0,
                usage.prompt_tokens)
    return turn, text or ""


def test_block_size_is_learned_from_the_engines(kvgate: Gateway, fleet_file: Path) -> None:
    models = yaml.safe_load(fleet_file.read_text())["models"]
    assert all("block_size" not in m for m in models)  # nothing tells kvgate the engines' block size
    body = {"messages": chat(unique_text(1500))}
    first, _ = send_checked(kvgate, body, "cold", stream=False)
    explained = settled_explain(kvgate, body)
    assert explained["block_size"] == BLOCK_SIZE
    holder = rows(explained)[first.replica]
    # The whole prompt but its last partial block is held (the reply's tokens are not in a chat prompt).
    assert credited(holder) >= (first.prompt_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE > 0
    again, _ = send_checked(kvgate, body, "again", stream=True)
    assert again.replica == first.replica
    assert again.credited == again.engine_cached > 0


def test_credited_tokens_equal_the_engines_cached_tokens_on_every_request(
    kvgate: Gateway, replicas: list[VllmReplica]
) -> None:
    """Three conversations over documents of ~1k-3.6k tokens, four follow-ups each (streamed and not), and two
    completions given as token ids, one an exact multiple of the block size (the engine recomputes its last block)."""
    turns: list[Turn] = []
    conversations = [[{"role": "system", "content": unique_text(tokens)}] for tokens in (1000, 2400, 3600)]
    for round_no in range(5):
        for c, history in enumerate(conversations):
            question = unique_text(80 + 40 * round_no)
            body = {"messages": chat(question, *history)}
            turn, answer = send_checked(kvgate, body, f"conversation {c} turn {round_no}", stream=(round_no + c) % 2 == 0)
            turns.append(turn)
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    ids = tokenize(replicas[0], {"prompt": unique_text(3200)})
    exact = ids[: 94 * BLOCK_SIZE]
    for label, prompt in (("exact multiple, cold", exact), ("exact multiple, warm", exact),
                          ("exact multiple + 1", ids[: 94 * BLOCK_SIZE + 1])):
        turns.append(send_checked(kvgate, {"prompt": prompt}, label, stream=False)[0])

    wrong = [t for t in turns if t.credited != t.engine_cached]
    assert not wrong, "kvgate credited != engine cached_tokens:\n" + "\n".join(
        f"  {t.label} on {t.replica}: kvgate {t.credited}, engine {t.engine_cached} of {t.prompt_tokens}" for t in wrong)
    warm = [t for t in turns if t.engine_cached > 0]
    assert len(warm) >= len(turns) // 2  # the workload is mostly warm, so the equality is not about zeros


def test_evictions_tracked_against_the_engines_own_state(kvgate: Gateway, replicas: list[VllmReplica]) -> None:
    """Fill one replica's small cache well past its size with prompts sent straight to it (as another client would),
    then compare what kvgate credits for each prompt with the engine's state rebuilt from its replay buffer."""
    target = replicas[0]
    prompts = [{"messages": chat(unique_text(2800))} for _ in range(10)]  # ~1.7x the cache
    for body in prompts:
        send_direct(target, body)
    token_ids = [tokenize(target, body) for body in prompts]
    assert sum(len(t) for t in token_ids) > 1.5 * SMALL_CACHE_BLOCKS * BLOCK_SIZE

    state = replay_state(target.replay_endpoint)
    assert state.removed > 0, "no evictions: the test did not exercise them"
    expected = [state.reusable_tokens(ids) for ids in token_ids]
    assert expected[0] == 0 and expected[-1] > 0  # the oldest prompt was evicted, the newest is held

    latest: list[int] = []

    def kvgate_agrees() -> bool:
        latest[:] = [credited(rows(settled_explain(kvgate, body))[target.name]) for body in prompts]
        return latest == expected

    try:
        wait_for(kvgate_agrees, 15.0, "kvgate's credits to match the engine's state")
    except AssertionError:
        raise AssertionError(f"kvgate credits {latest}, engine state {expected} (replayed seq "
                             f"{state.first_seq}..{state.last_seq}, {state.removed} blocks removed)") from None
    # The rebuilt state is the engine's own: a held prompt sent again is served from exactly that much cache.
    assert send_direct(target, prompts[-1])["prompt_tokens_details"]["cached_tokens"] == expected[-1]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"function": {"name": "now"}},  # no type, description nor parameters: vLLM renders them (null where absent)
    {"function": {"parameters": {"type": "object"}, "strict": True, "name": "reorder", "x-vendor": 1},
     "type": "function", "defer_loading": False},  # keys out of order, an unknown field, strict and defer_loading
]


def test_chat_with_tools_renders_as_the_engine(kvgate: Gateway, replicas: list[VllmReplica]) -> None:
    """vLLM hands the chat template each tool as its request model dumps it back (field order, null description
    and parameters, unknown fields dropped), not as sent: kvgate's prompt must be the engine's token for token, or
    the tools' text at the start of the prompt hides every cached block."""
    target = replicas[0]
    # tool_choice "none": "auto" (the default with tools) needs a tool-call parser the engine is not started with;
    # the tools are rendered all the same.
    body = {"messages": chat(unique_text(600)), "tools": TOOLS, "tool_choice": "none"}
    engine_ids = tokenize(target, body)
    assert settled_explain(kvgate, body)["prompt_tokens"] == len(engine_ids)
    usage = send_direct(target, body)
    assert usage["prompt_tokens"] == len(engine_ids)
    state = replay_state(target.replay_endpoint)
    expected = state.reusable_tokens(engine_ids)
    assert expected >= len(engine_ids) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE > 0
    wait_for(lambda: credited(rows(settled_explain(kvgate, body))[target.name]) == expected or None, 10.0,
             "kvgate to credit the engine's cached tool prompt")
