"""What vLLM itself renders for the chat-template golden cases: the prompt token ids of each chat, Messages body and
model setup below, computed by vLLM 0.32's own renderer (``renderer_from_config`` and ``OnlineRenderer.render_chat``,
the path every chat request takes), or the error it answers; and the ids transformers' ``apply_chat_template`` (the
version vLLM runs with, loaded on its own) gives for the conversation and arguments vLLM handed it. Written to
tests/fixtures/chat_templates/vllm_rendered.json, which tests/unit/test_chat_templates_golden.py and
tests/unit/test_chat_template_logic.py hold kvgate's rendering to, with vLLM's answers for small templates' content
format and inline-system probe.

Each model setup is kvgate's shipped tokenizer (loadgen/assets/tokenizer, ``bos_token: null``), changed as the setup
says (tokenizer_config.json entries, template files beside it), served with an operator template (``--chat-template``:
vLLM's example templates in tests/fixtures/chat_templates/vllm_examples, kvgate's own probes in .../kvgate), content
format and default kwargs. No weights are loaded: the model is a config.json made here.

Run with the real-engine environment's Python, which has vLLM 0.32 (scripts/engines_env.sh makes it):
    ~/.cache/kvgate/engines-venv/bin/python scripts/vllm_render_golden.py
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "loadgen" / "assets" / "tokenizer"
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"
OUT = FIXTURES / "vllm_rendered.json"

EXAMPLES = "vllm_examples"
LLAMA_DATE = {"date_string": "26 Jul 2024"}  # the Llama templates otherwise print today's date
SPECIAL_TOKENS = {
    "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
                  "rstrip": False, "single_word": False, "special": True},
    "unk_token": None,
    "image_token": "<|im_start|>",
    "extra_special_tokens": {"audio_token": "<|im_end|>"},
}

MODELS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "hermes": {"chat_template": f"{EXAMPLES}/tool_chat_template_hermes.jinja"},
    "llama3.1_json": {"chat_template": f"{EXAMPLES}/tool_chat_template_llama3.1_json.jinja",
                      "default_kwargs": LLAMA_DATE},
    "llama3.2_json": {"chat_template": f"{EXAMPLES}/tool_chat_template_llama3.2_json.jinja",
                      "default_kwargs": LLAMA_DATE},
    "mistral": {"chat_template": f"{EXAMPLES}/tool_chat_template_mistral.jinja"},
    "deepseekv3": {"chat_template": f"{EXAMPLES}/tool_chat_template_deepseekv3.jinja"},
    "phi4_mini": {"chat_template": f"{EXAMPLES}/tool_chat_template_phi4_mini.jinja"},
    "chatml": {"chat_template": f"{EXAMPLES}/template_chatml.jinja"},
    "gemma3_pythonic": {"chat_template": f"{EXAMPLES}/tool_chat_template_gemma3_pythonic.jinja"},
    "string_dump": {"chat_template": "kvgate/string_dump.jinja", "default_kwargs": {"greeting": "hello"}},
    "string_dump-special-tokens": {"chat_template": "kvgate/string_dump.jinja", "tokenizer_config": SPECIAL_TOKENS},
    "string_dump-as-openai": {"chat_template": "kvgate/string_dump.jinja", "content_format": "openai"},
    "openai_dump": {"chat_template": "kvgate/openai_dump.jinja"},
    "openai_dump-as-string": {"chat_template": "kvgate/openai_dump.jinja", "content_format": "string"},
    "named-templates": {"tokenizer_config": {"chat_template": [
        {"name": "default", "template": "kvgate/string_dump.jinja"},
        {"name": "tool_use", "template": "kvgate/openai_dump.jinja"}]}},
    "template-files": {"tokenizer_files": {"chat_template.jinja": "kvgate/openai_dump.jinja",
                                           "additional_chat_templates/tool_use.jinja": "kvgate/string_dump.jinja"}},
}
"""Model setups: ``chat_template`` (the operator's, a file under tests/fixtures/chat_templates), ``content_format``,
``default_kwargs``, ``tokenizer_config`` (entries replacing the shipped tokenizer_config.json's; a template there is
named by its file) and ``tokenizer_files`` (template files written beside it)."""

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ANSWER = {"role": "assistant", "content": "Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Germany?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
CALL_ID = "call_abc123xyz"  # Mistral's template wants ids of 9 characters or more


def tool_call(arguments: str, call_id: str = CALL_ID) -> dict[str, Any]:
    """A tool call in the key order vLLM's request validation gives it (id, function: arguments, name, type)."""
    return {"id": call_id, "function": {"arguments": arguments, "name": "get_weather"}, "type": "function"}


CHAT: dict[str, dict[str, Any]] = {
    "user": {"messages": [USER]},
    "system": {"messages": [SYSTEM, USER]},
    "multi-turn": {"messages": [SYSTEM, USER, ANSWER, FOLLOW_UP]},
    "content-parts": {"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "Part one."},
        {"type": "text", "text": "Part two?", "cache_control": {"type": "ephemeral"}}]}]},
    "system-parts": {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                                                 {"type": "text", "text": "Be kind."}]}, USER]},
    "tools": {"messages": [SYSTEM, {"role": "user", "content": "Weather in Tokyo?"}], "tools": [WEATHER],
              "tool_choice": "none"},
    "tool-call-history": {"messages": [
        SYSTEM, {"role": "user", "content": "Will it rain in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": '{"forecast": "rain"}'}],
        "tools": [WEATHER], "tool_choice": "none"},
    "tool-call-odd-arguments": {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [tool_call("not json"), tool_call("[1, 2]", "call_def456uvw"), tool_call("", "call_ghi789rst")]},
        {"role": "tool", "tool_call_id": CALL_ID,
         "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "user", "content": "Thanks."}]},
    "empty-tool-calls": {"messages": [USER, {"role": "assistant", "content": "Paris.", "tool_calls": []}, FOLLOW_UP]},
    "reasoning-and-names": {"messages": [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": "Hello.", "reasoning": "Greet back.", "name": "bot"}, FOLLOW_UP]},
    "continue-final-message": {"messages": [SYSTEM, USER, {"role": "assistant", "content": "The capital of France is"}],
                               "add_generation_prompt": False, "continue_final_message": True},
    "no-generation-prompt": {"messages": [SYSTEM, USER, ANSWER], "add_generation_prompt": False},
    "developer": {"messages": [{"role": "developer", "content": "Answer in French."}, USER]},
    "developer-after-system": {"messages": [
        SYSTEM, {"role": "developer", "content": "Answer in French."}, USER, ANSWER,
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, FOLLOW_UP]},
    "inline-system": {"messages": [SYSTEM, USER, ANSWER, {"role": "system", "content": "Reminder: be brief."},
                                   FOLLOW_UP]},
    "billing-header": {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=abc\nYou are Claude Code."},
        USER]},
    "reasoning-effort": {"messages": [USER], "reasoning_effort": "high"},
    "kwargs-precedence": {"messages": [USER], "reasoning_effort": "low", "chat_template_kwargs": {
        "reasoning_effort": "high", "enable_thinking": False, "greeting": "hi", "date_string": "01 Jan 2025"}},
    "kwargs-unset": {"messages": [USER], "chat_template_kwargs": {"greeting": None, "date_string": "auto",
                                                                  "bos_token": "<|im_end|>"}},
    "kwargs-messages": {"messages": [USER], "chat_template_kwargs": {"messages": "hijack"}},
    "documents": {"messages": [USER], "documents": [{"title": "Atlas", "text": "Paris is in France."}]},
    "add-special-tokens": {"messages": [USER], "add_special_tokens": True},
}
"""Chat completions bodies (``model`` is added)."""

MESSAGES: dict[str, dict[str, Any]] = {
    "inline-system": {"system": "Lead.", "messages": [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "A."},
        {"role": "system", "content": "Reminder."}, {"role": "user", "content": "two"}]},
    "thinking-disabled": {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "q"}]},
    "effort": {"output_config": {"effort": "high"}, "messages": [{"role": "user", "content": "q"}]},
    "billing-blocks": {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                                  {"type": "text", "text": "You are Claude Code."}],
                       "messages": [{"role": "user", "content": "hi"}]},
}
"""Anthropic Messages bodies (``model`` and ``max_tokens`` are added)."""

CONTENT_FORMAT_TEMPLATES = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content[1:] %}{% endfor %}{% endfor %}",
    "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{% endfor %}{% endfor %}",
    "{% set a = messages %}{% set b = a | reverse %}{% for m in b %}{% for p in m.content %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(m=messages) %}{% for m in ns.m %}{% for p in m.content %}{% endfor %}{% endfor %}",
    ("{% macro parts(c) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}{{ parts(m.content) }}"
     "{% endfor %}"),
    ("{% macro parts(x, items) %}{% for p in items %}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ parts(1, items=m['content']) }}{% endfor %}"),
    ("{% macro parts(content) %}{% for p in content %}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ parts(m.role) }}{% endfor %}"),
    "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}",
    "{% for t in tools %}{% for p in t.content %}{% endfor %}{% endfor %}",
    "{% for i, m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
    "{% set a, b = messages %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% generation %}{% for p in m.content %}{% endfor %}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}",
]
"""Templates whose content format vLLM's ``_detect_content_format`` decides (tests/unit/test_chat_template_logic.py
holds kvgate's detection to its answers)."""

INLINE_SYSTEM_TEMPLATES = [
    "",
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('no') }}{% endif %}"
     "{% endfor %}"),
    ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ 1 / 0 if false else undefined_x.y }}"
     "{% endif %}{% endfor %}"),
    "{{ strftime_now('%Y') }}",
    "{% generation %}x{% endgeneration %}",
    "{{ messages | tojson }}",
    "{% if %}",
]
"""Templates vLLM's inline-system probe (``_detect_merge_inline_system``) answers for."""


def template_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def tokenizer_dir(setup: dict[str, Any], into: Path) -> Path:
    """The shipped tokenizer, changed as ``setup`` says (tests/unit/test_chat_templates_golden.py does the same)."""
    shutil.copyfile(TOKENIZER / "tokenizer.json", into / "tokenizer.json")
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    for key, value in setup.get("tokenizer_config", {}).items():
        if key == "chat_template":
            value = [{"name": entry["name"], "template": template_text(entry["template"])} for entry in value]
        config[key] = value
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    for relative, source in setup.get("tokenizer_files", {}).items():
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        (into / relative).write_text(template_text(source), encoding="utf-8")
    return into


def model_dir(into: Path) -> Path:
    """A model vLLM can configure around the tokenizer: a tiny Llama config, no weights."""
    from transformers import LlamaConfig

    vocab = json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    size = len(vocab["model"]["vocab"]) + len(vocab.get("added_tokens", []))
    LlamaConfig(vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096).save_pretrained(into)
    return into


class Served:
    """One model setup as ``vllm serve --chat-template ... --chat-template-content-format ...
    --default-chat-template-kwargs ...`` would render it."""

    def __init__(self, model: Path, tokenizer: Path, setup: dict[str, Any]) -> None:
        from transformers import AutoTokenizer
        from vllm.config import ModelConfig, VllmConfig
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import renderer_from_config

        self.model_config = ModelConfig(model=str(model), tokenizer=str(tokenizer))
        renderer = renderer_from_config(VllmConfig(model_config=self.model_config))
        self.tokenizer = renderer.get_tokenizer()
        self.hf = AutoTokenizer.from_pretrained(tokenizer)
        self.operator_template = (
            load_chat_template(str(FIXTURES / setup["chat_template"])) if "chat_template" in setup else None
        )
        defaults = {**setup.get("default_kwargs", {})}
        defaults.setdefault("cohere_format", "cmd4")  # resolve_default_chat_template_kwargs, as the server does
        self.online = OnlineRenderer(
            self.model_config, renderer, request_logger=None, chat_template=self.operator_template,
            chat_template_content_format=setup.get("content_format", "auto"), default_chat_template_kwargs=defaults,
        )
        self.merges_inline_system = AnthropicServingMessages._should_merge_inline_system(self.online)
        self.disabled_thinking_effort = asyncio.run(_ProbeHost(self).probe())
        self.applied: dict[str, Any] | None = None
        original = self.tokenizer.apply_chat_template

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.applied = dict(kwargs)
            return original(*args, **kwargs)

        self.tokenizer.apply_chat_template = recorded

    def render(self, request: Any) -> dict[str, Any]:
        """The request's prompt ids, and transformers' for what vLLM handed apply_chat_template; or the error vLLM
        answers."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        self.applied = None
        try:
            result = asyncio.run(self.online.render_chat(request))
        except Exception as err:  # noqa: BLE001 - whatever vLLM raises, the request fails
            return {"error": f"{type(err).__name__}: {err}"}
        if isinstance(result, ErrorResponse):
            return {"error": result.error.message}
        _, (engine_input,) = result
        applied = copy.deepcopy(self.applied or {})
        assert applied["tokenize"] is False
        text = self.hf.apply_chat_template(applied.pop("conversation"), **applied)
        transformers_ids = self.hf(text, add_special_tokens=request.add_special_tokens)["input_ids"]
        return {"ids": list(engine_input["prompt_token_ids"]), "transformers_ids": transformers_ids}


class _ProbeHost:
    """Just what ``AnthropicServingMessages``' disabled-thinking probe reads of itself, so vLLM's own probe runs."""

    def __init__(self, served: Served) -> None:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self.online_renderer = served.online
        self.model_config = served.model_config
        self._render_probe_prompt = AnthropicServingMessages._render_probe_prompt.__get__(self)
        self._probe = AnthropicServingMessages._probe_disabled_thinking_effort.__get__(self)

    def _extract_prompt_components(self, prompt: Any) -> Any:
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        return extract_prompt_components(self.model_config, prompt)

    async def probe(self) -> str:
        return await self._probe()


def messages_conversions() -> dict[str, dict[str, Any]]:
    """Each Messages body as vLLM converts it, both ways: what kvgate's Messages parser hands the tokenizer."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    out = {}
    for name, body in MESSAGES.items():
        request = AnthropicMessagesRequest(**{"model": "m", "max_tokens": 16, **body})
        in_place, merged = (
            AnthropicServingMessages.to_chat_completion_request(request, merge_inline_system=merge).messages
            for merge in (False, True)
        )
        out[name] = {
            "body": body, "messages": in_place,
            "system_merged": merged if any(m["role"] == "system" for m in body["messages"]) else None,
            "reasoning_effort": body.get("output_config", {}).get("effort"),
            "thinking_disabled": body.get("thinking", {}).get("type") == "disabled",
        }
    return out


def main() -> int:
    import transformers
    import vllm
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.hf import _detect_content_format

    print("vLLM logs a traceback for each template below that does not parse; they are expected", file=sys.stderr)
    fixture: dict[str, Any] = {
        "vllm": vllm.__version__, "transformers": transformers.__version__,
        "content_formats": [[t, _detect_content_format(t, default="string")] for t in CONTENT_FORMAT_TEMPLATES],
        "inline_system": [
            [t, AnthropicServingMessages._detect_merge_inline_system(t)] for t in INLINE_SYSTEM_TEMPLATES
        ],
        "models": {}, "chat": CHAT, "messages": messages_conversions(), "expected": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp) / "model")
        for name, setup in MODELS.items():
            served = Served(model, tokenizer_dir(setup, Path(tempfile.mkdtemp(dir=tmp))), setup)
            fixture["models"][name] = {"setup": setup, "merges_inline_system": served.merges_inline_system,
                                       "disabled_thinking_effort": served.disabled_thinking_effort}
            expected: dict[str, Any] = {"chat": {}, "messages": {}}
            for case, body in CHAT.items():
                expected["chat"][case] = served.render(ChatCompletionRequest(**{"model": "m", **body}))
            for case, body in MESSAGES.items():
                thinking_off = body.get("thinking", {}).get("type") == "disabled"
                request = AnthropicServingMessages.to_chat_completion_request(
                    AnthropicMessagesRequest(**{"model": "m", "max_tokens": 16, **body}),
                    merge_inline_system=served.merges_inline_system,
                    disabled_thinking_effort=served.disabled_thinking_effort if thinking_off else "none",
                )
                expected["messages"][case] = served.render(request)
            fixture["expected"][name] = expected
            print(f"{name}: merge={served.merges_inline_system} disabled_effort={served.disabled_thinking_effort}")
    OUT.write_text(_dumps(fixture) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


def _dumps(fixture: dict[str, Any]) -> str:
    """The fixture as JSON, one line per case, so a re-run's diff shows which cases changed."""
    def line(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    lines = ["{", f' "vllm": {line(fixture["vllm"])},', f' "transformers": {line(fixture["transformers"])},']
    for key in ("content_formats", "inline_system"):
        lines.append(f' {line(key)}: [' + ",".join(f"\n  {line(pair)}" for pair in fixture[key]) + "\n ],")
    lines.append(' "models": {' + ",".join(f"\n  {line(k)}: {line(v)}" for k, v in fixture["models"].items()) + "\n },")
    lines.append(' "chat": {' + ",".join(f"\n  {line(k)}: {line(v)}" for k, v in fixture["chat"].items()) + "\n },")
    lines.append(' "messages": {' + ",".join(f"\n  {line(k)}: {line(v)}" for k, v in fixture["messages"].items())
                 + "\n },")
    models = []
    for model, expected in fixture["expected"].items():
        kinds = []
        for kind, cases in expected.items():
            kinds.append(f"\n   {line(kind)}: {{" + ",".join(f"\n    {line(k)}: {line(v)}" for k, v in cases.items())
                         + "\n   }")
        models.append(f"\n  {line(model)}: {{" + ",".join(kinds) + "\n  }")
    lines.append(' "expected": {' + ",".join(models) + "\n }")
    lines.append("}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
