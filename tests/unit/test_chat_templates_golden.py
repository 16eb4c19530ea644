"""Golden tests on real chat templates.

- Small tokenizers shaped like Llama 3.1's and Qwen 2.5's, carrying those models' real chat templates (built by
  scripts/build_chat_fixtures.py): kvgate's prompt token ids (what the gateway routes on) and the simulated engine's
  both equal transformers' ``apply_chat_template(..., tokenize=True)`` on the messages as vLLM hands them over.
- vLLM's example chat templates (tests/fixtures/chat_templates/vllm_examples) and kvgate's own probes (.../kvgate)
  served around kvgate's shipped tokenizer (``bos_token: null``), each with its operator settings: kvgate's ids for
  chat and Messages bodies equal both vLLM 0.32's own rendering and transformers' ``apply_chat_template`` (5.19, the
  version vLLM 0.32 runs with) on the conversation and arguments vLLM handed it, both recorded in
  tests/fixtures/chat_templates/vllm_rendered.json by scripts/vllm_render_golden.py; what vLLM refuses, kvgate
  refuses; kvgate's probes of each setup agree with vLLM's. (This environment's transformers is newer and renders
  some of these differently: it drops null message fields and copies ``reasoning`` into ``thinking``.)

A missing fixture fails.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import transformers

from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.loadgen.sim.tokenizer import SimTokenizer
from kvgate.router.core.config import ModelConfig
from kvgate.router.prompts.model_templates import TemplateSettings
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.prompt import ChatPrompt, PromptError
from kvgate.router.prompts.tokenizer import PromptTokenizer
from tests.tokenizing import tokenize_body

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
MODELS = ["llama3", "qwen2"]
VLLM: dict[str, Any] = json.loads((FIXTURES / "vllm_rendered.json").read_text(encoding="utf-8"))
"""What vLLM renders for each model setup and body (scripts/vllm_render_golden.py)."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]},
    },
}
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one sentence."}
HISTORY = [
    SYSTEM,
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And how many people live there?"},
]
TOOL_TURN = [
    SYSTEM,
    {"role": "user", "content": "Will it rain in Paris tomorrow?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "rain", "temperature": 14}'},
]

CASES: dict[str, dict[str, Any]] = {
    "system-and-user": {"messages": [SYSTEM, {"role": "user", "content": "Hello there!"}]},
    "user-only": {"messages": [{"role": "user", "content": "Summarize: the weather is sunny today."}]},
    "multi-turn": {"messages": HISTORY},
    "text-parts": {"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                                      {"type": "text", "text": "Part two?"}]}]},
    "tools": {"messages": [SYSTEM, {"role": "user", "content": "Weather in Tokyo?"}], "tools": [WEATHER_TOOL]},
    "tool-call-history": {"messages": TOOL_TURN, "tools": [WEATHER_TOOL]},
    "continue-final-message": {"messages": [*HISTORY[:3], {"role": "user", "content": "Say it again."},
                                            {"role": "assistant", "content": "The capital of France is"}],
                               "add_generation_prompt": False, "continue_final_message": True},
    "no-generation-prompt": {"messages": HISTORY[:3], "add_generation_prompt": False},
    "add-special-tokens": {"messages": HISTORY, "add_special_tokens": True},
    "unicode": {"messages": [{"role": "user", "content": "Café naïve – 東京 😀\n\n  spaced  out\t"}]},
}


def as_vllm_hands_them(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM passes to apply_chat_template: text parts joined, tool-call arguments as objects."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def expected_ids(hf: Any, case: dict[str, Any]) -> list[int]:
    options = {"tools": case.get("tools"), "add_generation_prompt": case.get("add_generation_prompt", True),
               "continue_final_message": case.get("continue_final_message", False)}
    messages = as_vllm_hands_them(case["messages"])
    if case.get("add_special_tokens"):
        text = hf.apply_chat_template(messages, tokenize=False, **options)
        return hf(text, add_special_tokens=True)["input_ids"]
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> tuple[str, Path, Any]:
    path = FIXTURES / request.param
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file(), f"missing {path}"
    return request.param, path, transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def kvgate_prompts(model: tuple[str, Path, Any]) -> Iterator[PromptTokenizer]:
    prompts = PromptTokenizer([ModelConfig(name="m", tokenizer=str(model[1]))])
    yield prompts
    prompts.close()


def body(case: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", **case}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_kvgate_prompt_ids_equal_transformers(
    model: tuple[str, Path, Any], kvgate_prompts: PromptTokenizer, name: str
) -> None:
    case = CASES[name]
    got = await tokenize_body(kvgate_prompts, "m", "chat", body(case))
    assert not got.approximate
    assert got.token_ids.tolist() == expected_ids(model[2], case)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sim_prompt_ids_equal_transformers(model: tuple[str, Path, Any], name: str) -> None:
    _, path, hf = model
    case = CASES[name]
    sim = SimTokenizer.from_path(path)
    got = sim.encode_chat(
        case["messages"], add_special_tokens=case.get("add_special_tokens", False), tools=case.get("tools"),
        add_generation_prompt=case.get("add_generation_prompt", True),
        continue_final_message=case.get("continue_final_message", False),
    )
    assert got == expected_ids(hf, case)


@pytest.mark.parametrize("text", ["Hello world", " leading space", "Café 東京 😀\n\nnew  lines\t", "<|im_start|>x"])
def test_completion_prompts_encode_as_transformers(model: tuple[str, Path, Any], text: str) -> None:
    _, path, hf = model
    sim = SimTokenizer.from_path(path)
    for special in (True, False):
        assert sim.encode(text, special) == hf(text, add_special_tokens=special)["input_ids"]


def test_the_llama_fixture_renders_its_real_template(model: tuple[str, Path, Any]) -> None:
    name, path, hf = model
    text = hf.apply_chat_template(as_vllm_hands_them(CASES["tools"]["messages"]), tools=[WEATHER_TOOL],
                                  add_generation_prompt=True, tokenize=False)
    if name == "llama3":
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
        assert '"name": "get_weather"' in text and text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert text.startswith("<|im_start|>system\nYou are a careful assistant.")
        assert "<tools>\n" in text and text.endswith("<|im_start|>assistant\n")


@dataclass
class Served:
    """One of vllm_rendered.json's model setups, as kvgate loads it."""

    config: ModelConfig
    prompts: PromptTokenizer


def tokenizer_dir(setup: dict[str, Any], into: Path) -> Path:
    """The shipped tokenizer, changed as the setup says (as scripts/vllm_render_golden.py does)."""
    shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", into / "tokenizer.json")
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    for key, value in setup.get("tokenizer_config", {}).items():
        if key == "chat_template":
            value = [{"name": entry["name"], "template": (FIXTURES / entry["template"]).read_text(encoding="utf-8")}
                     for entry in value]
        config[key] = value
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    for relative, source in setup.get("tokenizer_files", {}).items():
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        (into / relative).write_text((FIXTURES / source).read_text(encoding="utf-8"), encoding="utf-8")
    return into


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    setups: dict[str, Served] = {}
    for name, entry in VLLM["models"].items():
        setup = entry["setup"]
        directory = tokenizer_dir(setup, tmp_path_factory.mktemp(name))
        template = str(FIXTURES / setup["chat_template"]) if "chat_template" in setup else None
        config = ModelConfig(
            name="m", tokenizer=str(directory), chat_template=template,
            chat_template_content_format=setup.get("content_format", "auto"),
            default_chat_template_kwargs=setup.get("default_kwargs", {}),
        )
        setups[name] = Served(config, PromptTokenizer([config]))
    yield setups
    for setup in setups.values():
        setup.prompts.close()


def messages_prompt(case: str) -> ChatPrompt:
    """A Messages body as kvgate's Messages parser hands it over: vLLM's conversions of it, in place and merged."""
    conversion = copy.deepcopy(VLLM["messages"][case])
    return ChatPrompt(
        messages=conversion["messages"], add_generation_prompt=True, continue_final_message=False,
        add_special_tokens=False, chat_template=None, chat_template_kwargs=None, tools=None, documents=None,
        has_media=False, reasoning_effort=conversion["reasoning_effort"],
        thinking_disabled=conversion["thinking_disabled"], system_merged=conversion["system_merged"],
    )


async def kvgate_ids(setup: Served, kind: str, case: str) -> list[int]:
    if kind == "chat":
        result = await tokenize_body(setup.prompts, "m", "chat", {"model": "m", **copy.deepcopy(VLLM["chat"][case])})
    else:
        result = await setup.prompts.tokenize("m", lambda: messages_prompt(case))
    assert result.source == "local"
    return result.token_ids.tolist()


GOLDEN_CASES = [(model, kind, case) for model, expected in VLLM["expected"].items()
                for kind in ("chat", "messages") for case in expected[kind]]


@pytest.mark.parametrize(("model", "kind", "case"), GOLDEN_CASES)
async def test_kvgate_renders_what_vllm_renders(served: dict[str, Served], model: str, kind: str, case: str) -> None:
    expected = VLLM["expected"][model][kind][case]
    setup = served[model]
    if "error" in expected:
        with pytest.raises(PromptError):
            await kvgate_ids(setup, kind, case)
        return
    got = await kvgate_ids(setup, kind, case)
    assert got == expected["ids"]
    assert got == expected["transformers_ids"]


@pytest.mark.parametrize("model", sorted(VLLM["models"]))
def test_kvgate_probes_each_template_as_vllm_does(served: dict[str, Served], model: str) -> None:
    config = served[model].config
    assert config.tokenizer is not None
    templates = ModelTokenizer.from_path(config.tokenizer, TemplateSettings.of(config)).templates
    probes = VLLM["models"][model]
    assert templates.merges_inline_system == probes["merges_inline_system"]
    assert templates.disabled_thinking_effort == probes["disabled_thinking_effort"]
