"""The pure logic of rendering a chat as vLLM 0.32 does: content-format detection and the inline-system probe against
vLLM's own answers (recorded in tests/fixtures/chat_templates/vllm_rendered.json by scripts/vllm_render_golden.py),
special tokens, template choice and loading, kwargs precedence and filtering, the conversation, the disabled-thinking
probe and what a chat is planned to render with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from kvgate.router.core.config import ModelConfig
from kvgate.router.prompts.chat_template import compile_chat_template, merges_inline_system
from kvgate.router.prompts.conversation import conversation_for_template, developer_as_system
from kvgate.router.prompts.model_templates import ModelTemplates, TemplateSettings
from kvgate.router.prompts.prompt import ChatPrompt
from kvgate.router.prompts.special_tokens import special_tokens
from kvgate.router.prompts.template_choice import (
    load_chat_template, resolve_template, select_template, tokenizer_templates,
)
from kvgate.router.prompts.template_kwargs import accepted_kwargs, merge_kwargs, server_defaults, template_kwargs

VLLM: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "vllm_rendered.json").read_text()
)
@pytest.mark.parametrize(("template", "expected"), VLLM["content_formats"])
def test_content_format_is_vllms(template: str, expected: str) -> None:
    try:
        detected = compile_chat_template(template, {}).detected_format
    except jinja2.TemplateSyntaxError:  # the format then matters only for a template given in the kwargs
        in_kwargs = chat(chat_template="{{ x }}", chat_template_kwargs={"chat_template": "{{ x }}"})
        detected = ModelTemplates(template, TemplateSettings(), {}).plan(in_kwargs).content_format
    assert detected == expected


def test_content_format_detection_ends_where_assignments_loop() -> None:
    template = ("{% set a = messages %}{% set b = a %}{% set a = b %}"
                "{% for m in b %}{% for p in m.content %}{% endfor %}{% endfor %}")
    assert compile_chat_template(template, {}).detected_format == "openai"


@pytest.mark.parametrize(("template", "expected"), VLLM["inline_system"])
def test_inline_system_probe_is_vllms(template: str, expected: bool) -> None:
    assert merges_inline_system(template) == expected


def test_inline_system_probe_lets_other_errors_through() -> None:
    with pytest.raises(TypeError):  # vLLM's server does not start with such a template
        merges_inline_system("{{ messages | tojson }}{{ undefined_value | tojson }}")


def test_special_tokens_are_transformers_named_ones() -> None:
    added = {"__type": "AddedToken", "content": "<s>", "special": True}
    config = {"bos_token": added, "eos_token": "</s>", "unk_token": None, "pad_token": "", "add_bos_token": True,
              "image_token": "<img>", "tokenizer_class": "x", "legacy_token": {"content": "ignored"},
              "extra_special_tokens": {"audio_token": "<aud>", "eos_token": "<eot>"}}
    assert special_tokens(config) == {"bos_token": "<s>", "eos_token": "<eot>", "pad_token": "", "image_token": "<img>",
                                      "audio_token": "<aud>"}
    assert special_tokens({"additional_special_tokens": {"video_token": "<vid>"}}) == {"video_token": "<vid>"}
    assert special_tokens({"additional_special_tokens": ["<a>"], "extra_special_tokens": ["<b>"]}) == {}
    with pytest.raises(ValueError, match="bos_token"):
        special_tokens({"bos_token": {"content": "<s>"}})


def test_tokenizer_templates_as_transformers_loads_them(tmp_path: Path) -> None:
    assert tokenizer_templates(tmp_path, {"chat_template": "t"}) == "t"
    listed = [{"name": "default", "template": "d"}, {"name": "tool_use", "template": "u"}]
    assert tokenizer_templates(tmp_path, {"chat_template": listed}) == {"default": "d", "tool_use": "u"}
    (tmp_path / "chat_template.jinja").write_text("file")
    assert tokenizer_templates(tmp_path, {"chat_template": listed}) == "file"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("rag")
    assert tokenizer_templates(tmp_path, {"chat_template": "t"}) == {"default": "file", "rag": "rag"}


def test_template_choice_as_transformers_and_vllm_make_it() -> None:
    named = {"default": "d", "tool_use": "u"}
    assert select_template(named, None, None) == "d"
    assert select_template(named, None, []) == "u"  # an empty list is tools too
    assert select_template(named, "tool_use", None) == "u"  # a name picks a template
    assert select_template(named, "{{ x }}", None) == "{{ x }}"
    assert select_template("own", None, [{}]) == "own" and select_template("own", "given", None) == "given"
    assert resolve_template({"rag": "r"}, None, None) is None and resolve_template(None, None, None) is None
    with pytest.raises(ValueError):
        select_template({"rag": "r"}, None, None)


def test_an_operator_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("from file")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "from file"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template("line one\nline two") == "line one\nline two"
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        load_chat_template(str(tmp_path))  # a directory


def test_merge_keeps_defaults_and_drops_unset_overrides() -> None:
    assert merge_kwargs({"a": 1, "b": None}, {"a": None, "c": "auto", "d": 0, "e": False}) == {
        "a": 1, "b": None, "d": 0, "e": False}
    assert server_defaults({}) == {"cohere_format": "cmd4"}
    assert server_defaults({"cohere_format": "cmd3"}) == {"cohere_format": "cmd3"}


def kwargs_for(request: dict[str, Any] | None, effort: str | None = None, **fields: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False, "documents": None,
                               "tools": None, "defaults": {"greeting": "default", "tools": ["default"]},
                               "chat_template": None}
    return template_kwargs(request, reasoning_effort=effort, **{**options, **fields})


def test_kwargs_precedence_is_vllms() -> None:
    assert kwargs_for(None) == {"greeting": "default", "tools": ["default"], "tokenize": False,
                                "add_generation_prompt": True, "continue_final_message": False, "return_dict": False}
    request = {"greeting": "request", "add_generation_prompt": False, "documents": ["request"], "tools": ["request"]}
    merged = kwargs_for(request, tools=["real"], documents=None)
    assert (merged["greeting"], merged["add_generation_prompt"], merged["documents"], merged["tools"]) == (
        "request", True, ["request"], ["request"])  # fields over request kwargs over tools over defaults
    assert kwargs_for({"greeting": None, "tokenize": "auto"})["greeting"] == "default"
    assert kwargs_for(None, chat_template="t")["chat_template"] == "t"


def test_a_reasoning_effort_sets_enable_thinking_unless_the_request_names_it() -> None:
    assert (kwargs_for(None, "none")["enable_thinking"], kwargs_for(None, "low")["enable_thinking"]) == (False, True)
    assert kwargs_for({"enable_thinking": True}, "none")["enable_thinking"] is True
    assert "enable_thinking" not in kwargs_for({"enable_thinking": None}, "high")
    assert "enable_thinking" not in kwargs_for(None) and "reasoning_effort" not in kwargs_for(None)
    assert kwargs_for({"reasoning_effort": "max"}, "low")["reasoning_effort"] == "low"


def test_only_apply_parameters_and_template_variables_pass() -> None:
    kwargs = {"add_generation_prompt": True, "padding": True, "self": 1, "tokenize": False, "chat_template": "t",
              "used": 1, "unused": 2, "reasoning_effort": "low"}
    assert accepted_kwargs(kwargs, frozenset({"used", "messages"})) == {
        "add_generation_prompt": True, "padding": True, "self": 1, "used": 1}


def test_the_conversation_as_vllm_builds_it() -> None:
    messages = [
        {"role": "system", "content": None, "name": 3},
        {"role": "user", "content": [{"type": "text", "text": None}, "plain", {"type": "refusal", "refusal": "r"},
                                     {"type": "text", "text": "t", "cache_control": {}, "uuid": None}]},
        {"role": "assistant", "content": "a", "reasoning": "why", "tool_calls": [], "tool_call_id": "x"},
        {"role": "tool", "tool_call_id": None, "content": [{"type": "tool_reference", "name": "f"}]},
    ]
    assert conversation_for_template(messages, "string") == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "plain\nr\nt"},
        {"role": "assistant", "content": "a", "reasoning": "why", "reasoning_content": "why"},
        {"role": "tool", "content": "f", "tool_call_id": None},
    ]
    openai = conversation_for_template(messages, "openai")
    assert openai[0]["content"] == [] and openai[3]["content"] == [{"type": "tool_reference", "name": "f"}]
    assert openai[1]["content"] == [{"type": "text", "text": "plain"}, {"type": "text", "text": "r"},
                                    {"type": "text", "text": "t", "cache_control": {}}]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "x"}}, {"text": "no type"},
                                  {"type": "text", "text": "x", "uuid": "u"}, {"type": "input_text"}, 7])
def test_parts_vllm_refuses_or_only_the_engine_renders(part: Any) -> None:
    with pytest.raises(ValueError):
        conversation_for_template([{"role": "user", "content": [part]}], "string")


def test_system_messages_are_consolidated_only_when_scattered() -> None:
    kept = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D", "tools": None}]
    assert developer_as_system(kept) == [{"role": "system", "content": "S\n\nD"}]
    alone = [{"role": "developer", "content": [{"type": "text", "text": "D"}], "name": "n", "tools": []},
             {"role": "user", "content": "u"}]
    assert developer_as_system(alone) == [{"role": "system", "content": [{"type": "text", "text": "D"}], "name": "n"},
                                          {"role": "user", "content": "u"}]
    late = [{"role": "user", "content": "u"}, {"role": "developer", "content": [{"type": "text", "text": "a"}, "b"]},
            {"role": "system", "content": ""}]
    assert developer_as_system(late) == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "u"}]


def chat(**fields: Any) -> ChatPrompt:
    options: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
                               "continue_final_message": False, "add_special_tokens": False, "chat_template": None,
                               "chat_template_kwargs": None, "tools": None, "documents": None, "has_media": False}
    return ChatPrompt(**{**options, **fields})


@pytest.mark.parametrize(
    ("template", "effort"),
    [
        ("{{ messages[0].content }}", "low"),  # ignores the effort
        ("{{ reasoning_effort }}", "none"),
        ("{{ enable_thinking }}", "none"),
        ("{% if reasoning_effort == 'none' %}{{ raise_exception('no') }}{% endif %}{{ reasoning_effort }}", "low"),
        ("{{ 'max' if reasoning_effort not in ['low', 'medium', 'high', 'xhigh'] else reasoning_effort }}", "low"),
    ],
)
def test_disabled_thinking_effort_is_probed_as_vllm_does(template: str, effort: str) -> None:
    assert ModelTemplates(template, TemplateSettings(), {}).disabled_thinking_effort == effort


def test_no_template_at_all_merges_and_disables_thinking_with_low() -> None:
    templates = ModelTemplates(None, TemplateSettings(), {})
    assert (templates.has_own, templates.merges_inline_system, templates.disabled_thinking_effort) == (
        False, True, "low")
    with pytest.raises(ValueError, match="no chat template"):
        templates.plan(chat())


def test_either_template_merging_means_merge() -> None:
    refuses = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('x') }}" \
              "{% endif %}{% endfor %}"
    assert ModelTemplates({"default": "ok", "tool_use": refuses}, TemplateSettings(), {}).merges_inline_system
    assert not ModelTemplates({"default": "ok", "tool_use": "ok"}, TemplateSettings(), {}).merges_inline_system
    assert not ModelTemplates({"default": refuses}, TemplateSettings(chat_template="ok"), {}).merges_inline_system


def test_a_plan_takes_the_merged_messages_and_the_disabled_effort() -> None:
    merged = [{"role": "system", "content": "S+T"}, {"role": "user", "content": "u"}]
    refusing = ModelTemplates("{{ raise_exception('x') if messages | length > 3 }}{{ reasoning_effort }}",
                              TemplateSettings(), {})
    accepting = ModelTemplates("{{ reasoning_effort }}", TemplateSettings(), {})
    prompt = chat(system_merged=merged, thinking_disabled=True, reasoning_effort="high")
    assert refusing.merges_inline_system and not accepting.merges_inline_system
    assert refusing.plan(prompt).messages is merged and accepting.plan(prompt).messages is prompt.messages
    assert refusing.disabled_thinking_effort == "none" and refusing.plan(prompt).kwargs["reasoning_effort"] == "none"
    assert refusing.plan(chat(reasoning_effort="high")).kwargs["reasoning_effort"] == "high"


def test_a_plan_picks_the_template_as_vllm_does() -> None:
    tokenizer = {"default": "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
                 "tool_use": "tools"}
    templates = ModelTemplates(tokenizer, TemplateSettings(), {})
    assert (templates.plan(chat()).source, templates.plan(chat()).content_format) == (tokenizer["default"], "openai")
    assert templates.plan(chat(tools=[])).source == "tools"
    own = templates.plan(chat(chat_template="tool_use"))  # a request may name one of the model's templates
    assert own.source == "tools" and own.template is not None
    body = templates.plan(chat(chat_template="{{ x }}"))
    assert (body.source, body.template, body.content_format) == ("{{ x }}", None, "auto")
    in_kwargs = templates.plan(chat(chat_template="{{ x }}", chat_template_kwargs={"chat_template": "{{ x }}"}))
    assert (in_kwargs.source, in_kwargs.content_format) == ("{{ x }}", "openai")  # the format stays the model's
    operator = ModelTemplates(tokenizer, TemplateSettings(chat_template="op", content_format="string"), {})
    ignored = operator.plan(chat(chat_template="{{ x }}", chat_template_kwargs={"chat_template": "{{ x }}"}))
    assert (ignored.source, ignored.content_format) == ("op", "string")  # the operator's beats the kwargs' one
    assert operator.plan(chat(chat_template="{{ x }}")).source == "{{ x }}"  # a request's own field beats it


def test_a_model_entry_with_default_kwargs_stays_hashable() -> None:
    entry = ModelConfig(name="m", default_chat_template_kwargs={"a": [1], "b": {"c": None}})
    same = ModelConfig(name="m", default_chat_template_kwargs={"b": {"c": None}, "a": [1]})
    assert entry == same and hash(entry) == hash(same) and entry in {same}
    assert TemplateSettings.of(entry) == TemplateSettings(None, "auto", {"a": [1], "b": {"c": None}})
