"""Workload generators: exact text → token-id round trip, seeds reproduce, trace arrivals/jitter/window; and how the
runner sends a chat request through each API (its body renders as the chat did)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvgate.loadgen.apis import WIRES, Usage, messages_body, responses_body, wire_for
from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.loadgen.sim import anthropic as sim_anthropic
from kvgate.loadgen.sim import responses as sim_responses
from kvgate.loadgen.sim.conversation import Conversation, render_text, tool_dicts
from kvgate.loadgen.sim.model import SimModel
from kvgate.loadgen.workloads import build_workload
from kvgate.loadgen.workloads.oracle import PrefixOracle
from kvgate.loadgen.workloads.request import WorkloadOptions, working_set_tokens
from kvgate.loadgen.workloads.trace import TRACE_BLOCK_TOKENS, TraceError, read_trace, timestamp_tick_ms
from kvgate.loadgen.workloads.vocabulary import vocabulary_for
from kvgate.router.prompts.model_tokenizer import ModelTokenizer

SMALL = dict(
    groups=3, prompts_per_group=4, system_tokens=64, question_tokens=16, sessions=3, turns=3, turn_tokens=20,
    think_s=0.5, documents=4, document_tokens=(100, 300), prompt_tokens=50, output_tokens=8, requests=12,
    context_tokens=400, long_tokens=(300, 600), long_output_tokens=(40, 80), chat_tokens=(10, 30),
    chat_output_tokens=(2, 8),
)
SYNTHETIC = ["shared-prefix", "multi-turn", "documents", "agentic", "unique", "pd-mix"]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A conversation-like trace: 3 s ticks, several rows per tick, a shared block 0, chained ids."""
    rows = []
    next_id = 1
    for tick in range(6):
        for k in range(4):
            n_blocks = 1 + (tick + k) % 3
            ids = [0] + list(range(next_id, next_id + n_blocks))
            next_id += n_blocks
            rows.append({"timestamp": tick * 3000, "input_length": 512 * n_blocks + 100 + k,
                         "output_length": 10 + k, "hash_ids": ids})
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _opts(**kw: object) -> WorkloadOptions:
    return WorkloadOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def test_vocabulary_is_large_and_every_word_round_trips(tokenizer: ModelTokenizer) -> None:
    vocab = vocabulary_for(TOKENIZER_DIR)
    assert len(vocab.ids) >= 3900
    ids = vocab.sample(random.Random(1), 5000)
    assert tokenizer.encode(vocab.render(ids)) == ids


@pytest.mark.parametrize("name", SYNTHETIC)
def test_prompt_tokens_are_what_the_engine_counts(name: str, tokenizer: ModelTokenizer) -> None:
    for r in build_workload(name, _opts()):
        if r.endpoint == "chat":
            ids = tokenizer.encode_chat(r.body["messages"])
        else:
            ids = tokenizer.encode(r.body["prompt"])
        assert len(ids) == r.prompt_tokens


def test_completion_text_round_trips_to_the_generated_ids(tokenizer: ModelTokenizer) -> None:
    """Documents share a long prefix: the text of two requests on one document tokenizes to the same leading ids."""
    reqs = build_workload("documents", _opts(documents=1, requests=2))
    a, b = (tokenizer.encode(r.body["prompt"]) for r in reqs)
    doc_len = reqs[0].prompt_tokens - SMALL["question_tokens"]
    assert a[:doc_len] == b[:doc_len] and a[doc_len:] != b[doc_len:]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_same_seed_same_requests_other_seed_differs(name: str) -> None:
    first, again, other = (build_workload(name, _opts(seed=s)) for s in (7, 7, 8))
    assert first == again
    assert [r.body for r in first] != [r.body for r in other]


def test_shared_prefix_shape_and_oracle() -> None:
    reqs = build_workload("shared-prefix", _opts(requests=None))
    assert len(reqs) == 3 * 4
    systems = {r.body["messages"][0]["content"] for r in reqs}
    assert len(systems) == 3
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    # The first request of each group misses; later ones hit the system prompt's full blocks.
    assert sum(r.oracle_hit_tokens == 0 for r in reqs) == 3


def test_multi_turn_history_grows_and_turns_chain() -> None:
    reqs = build_workload("multi-turn", _opts(requests=None))
    assert len(reqs) == 9
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        assert turns[0].after is None
        for prev, cur in zip(turns, turns[1:]):
            assert cur.after == prev.index
            assert cur.body["messages"][: len(prev.body["messages"])] == prev.body["messages"]
            assert cur.prompt_tokens > prev.prompt_tokens and cur.oracle_hit_tokens > 0


def test_agentic_sessions_grow_on_one_shared_prefix_and_branch_sub_agents() -> None:
    reqs = build_workload("agentic", _opts(requests=None, sessions=6, turns=8, subagent_prob=0.5))
    by_id = {r.index: r for r in reqs}
    system = reqs[0].body["messages"][0]
    assert all(r.body["messages"][0] == system for r in reqs)  # one tool/system prefix for every request
    assert all(r.oracle_hit_tokens >= SMALL["system_tokens"] for r in reqs[1:])
    sessions = {r.session_id for r in reqs}
    mains = {s for s in sessions if "-sub" not in s}
    assert len(mains) == 6 and len(sessions) > 6  # sub-agents branched off
    for r in reqs:
        if r.after is None:
            continue
        prev = by_id[r.after]
        if r.session_id == prev.session_id:  # a later turn: the whole history so far, grown
            assert r.body["messages"][: len(prev.body["messages"])] == prev.body["messages"]
            assert r.prompt_tokens > prev.prompt_tokens
        else:  # a sub-agent's first request: after its parent's turn, on the shared prefix only
            assert r.session_id.startswith(prev.session_id + "-sub") and len(r.body["messages"]) == 2
    last_turns = [max((r for r in reqs if r.session_id == s), key=lambda r: r.index) for s in mains]
    assert max(r.prompt_tokens for r in last_turns) > SMALL["context_tokens"]  # sessions grow toward the target


def test_working_set_is_the_distinct_prompt_tokens() -> None:
    reqs = build_workload("documents", _opts(documents=1, requests=3, document_tokens=(160, 160)))
    assert working_set_tokens(reqs) == 160 + 3 * SMALL["question_tokens"]


def test_documents_size_is_set_by_requests() -> None:
    assert len(build_workload("documents", _opts(requests=None))) == 200
    assert len(build_workload("documents", _opts(requests=450))) == 450


def test_unique_has_no_oracle_hits() -> None:
    assert all(r.oracle_hit_tokens == 0 for r in build_workload("unique", _opts()))


def test_unique_size_is_set_by_requests() -> None:
    assert len(build_workload("unique", _opts(requests=None))) == 200
    assert len(build_workload("unique", _opts(requests=450, prompt_tokens=32))) == 450


def test_pd_mix_mixes_long_requests_with_long_outputs_and_short_chat() -> None:
    reqs = build_workload("pd-mix", _opts(requests=400, long_fraction=0.25))
    long = [r for r in reqs if r.endpoint == "completions"]
    chat = [r for r in reqs if r.endpoint == "chat"]
    assert len(reqs) == 400 and 70 <= len(long) <= 130
    assert all(300 <= r.prompt_tokens <= 601 and 40 <= r.output_tokens <= 80 for r in long)  # + BOS
    assert all(r.prompt_tokens < 300 and 2 <= r.output_tokens <= 8 for r in chat)
    assert len({r.body["messages"][0]["content"] for r in chat}) == 4  # four shared system prompts
    assert all(r.oracle_hit_tokens == 0 for r in long)
    assert len(build_workload("pd-mix", _opts(requests=None))) == 200


def test_pd_mix_arrivals_follow_speed() -> None:
    normal, doubled = (build_workload("pd-mix", _opts(speed=s)) for s in (1.0, 2.0))
    assert [r.arrival_s / 2 for r in normal] == pytest.approx([r.arrival_s for r in doubled])
    assert [r.body for r in normal] == [r.body for r in doubled]


def test_rate_zero_sends_all_at_once() -> None:
    assert {r.arrival_s for r in build_workload("unique", _opts(rate=0))} == {0.0}


def test_oracle_counts_full_block_prefixes_only() -> None:
    oracle = PrefixOracle(block_size=4)
    first, second, third, fourth = (oracle.observe(ids) for ids in (
        [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 0, 0], [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8], [9, 2, 3, 4]))
    assert [hit for hit, _ in (first, second, third, fourth)] == [0, 8, 4, 0]
    # block 3 of the third equals the first's block 2, but not its prefix: a node of its own
    assert first[1] == second[1] == (0, 1)
    assert third[1][0] == 0 and len(set(third[1]) | set(first[1])) == 4
    assert fourth[1] not in (first[1][:1], third[1][:1])


def test_trace_prompts_follow_hash_ids_exactly(trace_file: Path, tokenizer: ModelTokenizer) -> None:
    rows = read_trace(trace_file)
    reqs = build_workload("trace", _opts(trace=trace_file, requests=None, seed=3))
    assert len(reqs) == len(rows)
    encoded = {r.index: tokenizer.encode(r.body["prompt"]) for r in reqs}
    assert all(len(encoded[r.index]) == r.prompt_tokens for r in reqs)
    # Every request shares exactly block 0 (512 tokens) with every other, and output lengths come from the trace.
    first = [ids[:TRACE_BLOCK_TOKENS] for ids in encoded.values()]
    assert all(f == first[0] for f in first)
    assert sorted(r.output_tokens for r in reqs) == sorted(row.output_length for row in rows)
    assert sorted(r.prompt_tokens for r in reqs) == sorted(row.input_length for row in rows)


def test_trace_arrivals_are_jittered_within_ticks_and_scaled(trace_file: Path) -> None:
    rows = read_trace(trace_file)
    assert timestamp_tick_ms(rows) == 3000
    fast = build_workload("trace", _opts(trace=trace_file, requests=None, speed=2.0))
    slow = build_workload("trace", _opts(trace=trace_file, requests=None, speed=1.0))
    assert [r.arrival_s * 2 for r in fast] == pytest.approx([r.arrival_s for r in slow])
    arrivals = sorted(r.arrival_s for r in slow)
    assert len(set(arrivals)) == len(arrivals)  # bursts are spread
    assert all(0 <= a < 18 for a in arrivals)
    # Within each 3 s tick there are exactly the trace's 4 rows.
    assert [sum(1 for a in arrivals if 3 * t <= a < 3 * (t + 1)) for t in range(6)] == [4] * 6
    assert [r.arrival_s for r in slow] != [r.arrival_s for r in build_workload("trace", _opts(trace=trace_file, requests=None, seed=1))]


def test_trace_window_and_first_n(trace_file: Path) -> None:
    window = build_workload("trace", _opts(trace=trace_file, requests=None, window_s=(6.0, 12.0)))
    assert len(window) == 8
    assert all(0 <= r.arrival_s < 6 for r in window)  # offsets from the window's start
    first = build_workload("trace", _opts(trace=trace_file, requests=5, window_s=(6.0, 12.0)))
    assert len(first) == 5
    short = build_workload("trace", _opts(trace=trace_file, requests=None, max_input_tokens=1000))
    assert len(short) == 8 and all(r.prompt_tokens <= 1000 for r in short)  # only the one-block rows


def test_bad_trace_is_refused_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match="bad.jsonl:2"):
        read_trace(bad)
    short = tmp_path / "short.jsonl"
    short.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="cannot cover"):
        read_trace(short)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_azure_trace_replays_arrivals_and_lengths_with_nothing_shared(tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(AZURE_HEADER + "2023-11-16 18:15:47.0000000,1200,3\n"  # out of order: sorted by arrival
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:48.5,600,0\n")
    rows = read_trace(trace)
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in rows] == [(0, 374, 44), (319, 1200, 3),
                                                                                 (1819, 600, 0)]
    assert [len(r.hash_ids) for r in rows] == [1, 3, 2]
    assert len({h for r in rows for h in r.hash_ids}) == 6  # every block its own: no prefix is shared
    reqs = build_workload("trace", _opts(trace=trace, requests=None, speed=2.0))
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.1595, 0.9095])
    assert [r.prompt_tokens for r in reqs] == [374, 1200, 600]
    assert [r.output_tokens for r in reqs] == [44, 3, 1]
    assert [len(tokenizer.encode(r.body["prompt"])) for r in reqs] == [374, 1200, 600]
    assert all(r.oracle_hit_tokens == 0 for r in reqs)


@pytest.mark.parametrize("text, message", [
    ("time,in,out\n", "header must be"),
    (AZURE_HEADER + "2023-11-16 18:15:46.68,12\n", "azure.csv:2"),
    (AZURE_HEADER + "2023-11-16 18:15:46.68,10,1\nyesterday,10,1\n", "azure.csv:3"),
    (AZURE_HEADER + "2023-11-16 18:15:46.68,0,1\n", "at least one token"),
])
def test_bad_azure_trace_is_refused_with_its_line(tmp_path: Path, text: str, message: str) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_trace(trace)


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", _opts())


TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "fix the bug"},
    {"role": "assistant", "content": "looking", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
    {"role": "tool", "tool_call_id": "call_2", "content": "print(2)"},
    {"role": "user", "content": "go on"},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                "parameters": {"type": "object", "properties": {}}}}]


def test_a_chat_becomes_the_messages_body_claude_code_sends() -> None:
    body = messages_body(TOOL_CHAT, "m", 64, CHAT_TOOLS)
    assert body["system"] == [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "call_1", "name": "read", "input": {"path": "a.py"}},
            {"type": "tool_use", "id": "call_2", "name": "read", "input": {"path": "b.py"}}]},
        {"role": "user", "content": [  # the tool results and the text after them: one turn, the breakpoint last
            {"type": "tool_result", "tool_use_id": "call_1", "content": "print(1)"},
            {"type": "tool_result", "tool_use_id": "call_2", "content": "print(2)"},
            {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]},
    ]
    assert body["tools"] == [{"name": "read", "description": "Read a file.",
                              "input_schema": {"type": "object", "properties": {}}}]
    assert (body["model"], body["max_tokens"], body["stream"]) == ("m", 64, True)
    empty = messages_body([{"role": "user", "content": ""}], "m", 1)
    assert empty["messages"] == [{"role": "user", "content": ""}] and "system" not in empty


@pytest.mark.parametrize("chat", [TOOL_CHAT, [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                                              {"role": "assistant", "content": ""}, {"role": "user", "content": ""},
                                              {"role": "system", "content": "late"}, {"role": "user", "content": "b"}]])
def test_the_messages_and_responses_bodies_render_as_the_chat(chat: list[dict[str, Any]]) -> None:
    """vLLM (the sim, in its image) renders each API's body as the same prompt as the chat it came from."""
    sim = SimModel.load("m", TOKENIZER_DIR)
    tools = CHAT_TOOLS if chat is TOOL_CHAT else None
    expected = render_text(sim.tokenizer, Conversation(chat, tools=tool_dicts(tools)))
    anthropic_body = messages_body(chat, "m", 8, tools)
    sim_anthropic.check_request(anthropic_body)
    assert render_text(sim.tokenizer, sim_anthropic.MessagesApi(sim, 8192, 16).conversation(anthropic_body)) == expected
    responses = responses_body(chat, "m", 8, tools)
    sim_responses.check_request(responses)
    turn = sim_responses.ResponsesApi(sim, 8192, 16, store=False).turn(responses)
    assert sim.tokenizer.decode(turn.prompt_ids) == expected


def test_each_api_stream_reads_to_text_usage_and_its_end() -> None:
    messages = WIRES["messages"]
    assert messages.read({"type": "message_start", "message": {"id": "chatcmpl-loadgen-3"}}).upstream_id == "loadgen-3"
    assert messages.read({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}).text
    usage = messages.read({"type": "message_delta", "usage": {
        "input_tokens": 4, "output_tokens": 2, "cache_creation_input_tokens": 16, "cache_read_input_tokens": 32}})
    assert usage.usage == Usage(prompt_tokens=52, cached_tokens=32, output_tokens=2) and not usage.done
    assert messages.read({"type": "message_stop"}).done
    assert messages.read({"type": "error", "error": {"type": "internal_error"}}).error
    responses = WIRES["responses"]
    assert responses.read({"type": "response.output_text.delta", "delta": "x"}).text
    completed = responses.read({"type": "response.completed", "response": {"usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 3}}})
    assert completed.done and completed.usage == Usage(40, 32, 3)
    chat = WIRES["chat"].read({"id": "chatcmpl-loadgen-1", "choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})
    assert chat.upstream_id == "loadgen-1" and chat.usage == Usage(9, 0, 1)


def test_completions_keep_their_endpoint_whatever_the_api() -> None:
    completion = build_workload("unique", _opts(requests=1))[0]
    assert wire_for(completion, "messages").path == "/v1/completions"
    chat = build_workload("agentic", _opts())[0]
    assert wire_for(chat, "messages").path == "/v1/messages"
    assert wire_for(chat, "responses").headers(chat) == {"X-Session-ID": chat.session_id}
    assert wire_for(chat, "messages").headers(chat) == {"anthropic-version": "2023-06-01",
                                                        "x-claude-code-session-id": chat.session_id}
