"""vLLM 0.32's and transformers 5's rules for rendering a chat, through kvgate's model tokenizer and prompt path:
special tokens, which template, content format, the conversation, the kwargs and continue_final_message. Each case
is one vLLM or transformers read differently from kvgate's earlier rendering (file:line in router/prompts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvgate.loadgen.assets import TOKENIZER_DIR
from kvgate.router.core.config import LimitsConfig, ModelConfig
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.prompt import ChatPrompt, PromptError
from kvgate.router.prompts.tokenizer import PromptTokenizer
from tests.tokenizing import tokenize_body

USER = [{"role": "user", "content": "hi"}]
DUMP = "{% for m in messages %}{{ m | tojson }};{% endfor %}"


def tokenizer_dir(tmp_path: Path, files: dict[str, str] | None = None, **config: Any) -> Path:
    """The shipped tokenizer with tokenizer_config.json entries replaced and template files beside it."""
    shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    base = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    for relative, text in (files or {}).items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def shipped() -> ModelTokenizer:
    return ModelTokenizer.from_path(TOKENIZER_DIR)


def test_a_null_special_token_is_no_variable_at_all(shipped: ModelTokenizer) -> None:
    template = "[{{ bos_token }}]{{ bos_token is defined }}{{ bos_token is none }}|{{ eos_token }}"
    assert shipped.render_chat(USER, chat_template=template) == "[]FalseFalse|<|im_end|>"


def test_every_named_special_token_reaches_the_template(tmp_path: Path) -> None:
    added = {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "normalized": False,
             "rstrip": False, "single_word": False, "special": True}
    model = ModelTokenizer.from_path(tokenizer_dir(
        tmp_path, cls_token=added, image_token="<|endoftext|>", extra_special_tokens={"audio_token": "<|im_end|>"}))
    template = "{{ cls_token }}|{{ image_token }}|{{ audio_token }}|{{ mask_token is defined }}"
    assert model.render_chat(USER, chat_template=template) == "<|im_start|>|<|endoftext|>|<|im_end|>|False"


def test_a_kwarg_replaces_a_special_token_the_template_reads(shipped: ModelTokenizer) -> None:
    rendered = shipped.render_chat(USER, chat_template="{{ eos_token }}", chat_template_kwargs={"eos_token": "<E>"})
    assert rendered == "<E>"


async def test_request_templates_get_the_same_special_tokens() -> None:
    prompts = PromptTokenizer([ModelConfig(name="m", tokenizer=str(TOKENIZER_DIR))],
                              limits=LimitsConfig(trust_request_chat_template=True))
    try:
        body = {"messages": USER, "chat_template": "[{{ bos_token }}]{{ bos_token is defined }}"}
        result = await tokenize_body(prompts, "m", "chat", body)
    finally:
        prompts.close()
    assert result.token_ids.tolist() == ModelTokenizer.from_path(TOKENIZER_DIR).encode("[]False", False)


def test_a_list_of_templates_gives_tool_use_when_there_are_tools(tmp_path: Path) -> None:
    model = ModelTokenizer.from_path(tokenizer_dir(tmp_path, chat_template=[
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "with tools"}]))
    assert model.render_chat(USER) == "plain"
    assert model.render_chat(USER, tools=[{"type": "function", "function": {"name": "f"}}]) == "with tools"


def test_template_files_beside_the_config_replace_its_template(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, {"chat_template.jinja": "from the file",
                                         "additional_chat_templates/tool_use.jinja": "tools from the file"})
    model = ModelTokenizer.from_path(directory)
    assert model.render_chat(USER) == "from the file"
    assert model.render_chat(USER, tools=[]) == "tools from the file"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # A macro looping over the parameter it is given message.content in: vLLM hands it parts.
        ("{% macro parts(c) %}{% for p in c %}<{{ p.text }}>{% endfor %}{% endmacro %}"
         "{% for m in messages %}{{ parts(m.content) }}{% endfor %}", "<hi>"),
        # A loop over a content that is no message's: vLLM hands over one string.
        ("{% for t in tools or [] %}{% for x in t.content %}{% endfor %}{% endfor %}"
         "{% for m in messages %}{{ m.content }}{% endfor %}", "hi"),
    ],
)
def test_content_format_is_detected_as_vllm_detects_it(shipped: ModelTokenizer, template: str, expected: str) -> None:
    assert shipped.render_chat(USER, chat_template=template) == expected


def test_developer_messages_become_one_leading_system_message(shipped: ModelTokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "developer", "content": "D", "tools": []}]
    assert shipped.render_chat(messages, chat_template=DUMP) == (
        '{"role": "system", "content": "S\\n\\nD"};{"role": "user", "content": "u"};')


def test_a_template_that_names_the_developer_role_keeps_it(shipped: ModelTokenizer) -> None:
    template = "{% if false %}'developer'{% endif %}" + DUMP
    rendered = shipped.render_chat([{"role": "developer", "content": "D"}], chat_template=template)
    assert rendered == '{"role": "developer", "content": "D", "tools": null};'


def test_the_billing_header_line_is_cut_from_system_messages(shipped: ModelTokenizer) -> None:
    messages = [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nReal"},
                {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=2"},
                                               {"type": "text", "text": "Kept"}]},
                {"role": "user", "content": "x-anthropic-billing-header: users keep it"}]
    assert shipped.render_chat(messages, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}") == (
        "[Real][Kept][x-anthropic-billing-header: users keep it]")


def test_tool_call_arguments_that_are_no_object_become_empty(shipped: ModelTokenizer) -> None:
    calls = [{"id": str(i), "type": "function", "function": {"name": "f", "arguments": arguments}}
             for i, arguments in enumerate(["[1, 2]", "7", "not json", '{"a": 1}'])]
    template = "{% for c in messages[0].tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}"
    rendered = shipped.render_chat([{"role": "assistant", "content": None, "tool_calls": calls}], False,
                                   chat_template=template)
    assert rendered == '{};{};{};{"a": 1};'


def test_the_task_field_is_kept(shipped: ModelTokenizer) -> None:
    rendered = shipped.render_chat([{"role": "user", "content": "u", "task": "t", "other": 1}], chat_template=DUMP)
    assert rendered == '{"role": "user", "content": "u", "task": "t"};'


def test_continue_final_message_cuts_at_the_message_not_at_a_later_match(shipped: ModelTokenizer) -> None:
    # "end" is also in the "<|im_end|>" written after the message.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "end"}]
    assert shipped.render_chat(messages, False, continue_final_message=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nend")


def test_continue_final_message_is_no_template_variable(shipped: ModelTokenizer) -> None:
    messages = [{"role": "assistant", "content": "x"}]
    template = "{{ messages[-1].content }}|{{ continue_final_message is defined }}"
    assert shipped.render_chat(messages, False, continue_final_message=True, chat_template=template) == "x"
    assert shipped.render_chat(messages, False, chat_template=template) == "x|False"


def test_the_generation_tag_renders_its_body(shipped: ModelTokenizer) -> None:
    template = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert shipped.render_chat(USER, chat_template=template) == "<hi>"


def test_a_kwarg_named_like_an_argument_fails_as_in_vllm(shipped: ModelTokenizer) -> None:
    with pytest.raises(TypeError):
        shipped.render_chat(USER, chat_template="{{ messages }}", chat_template_kwargs={"messages": []})


async def test_reasoning_effort_reaches_the_template_with_enable_thinking() -> None:
    prompts = PromptTokenizer([ModelConfig(name="m", tokenizer=str(TOKENIZER_DIR))],
                              limits=LimitsConfig(trust_request_chat_template=True))
    template = "{{ reasoning_effort }}|{{ enable_thinking }}"
    reference = ModelTokenizer.from_path(TOKENIZER_DIR)

    def prompt(effort: str, kwargs: dict[str, Any] | None) -> ChatPrompt:
        return ChatPrompt(messages=USER, add_generation_prompt=True, continue_final_message=False,
                          add_special_tokens=False, chat_template=template, chat_template_kwargs=kwargs, tools=None,
                          documents=None, has_media=False, reasoning_effort=effort)

    try:
        for effort, kwargs, expected in [("none", None, "none|False"), ("high", None, "high|True"),
                                         ("low", {"enable_thinking": None, "reasoning_effort": "max"}, "low|")]:
            result = await prompts.tokenize("m", lambda e=effort, k=kwargs: prompt(e, k))
            assert result.token_ids.tolist() == reference.encode(expected, False), (effort, kwargs)
    finally:
        prompts.close()


async def test_an_unreadable_operator_template_is_a_config_error(tmp_path: Path) -> None:
    from kvgate.router.core.errors import ConfigError

    with pytest.raises(ConfigError, match="models.m.chat_template"):
        PromptTokenizer([ModelConfig(name="m", tokenizer=str(TOKENIZER_DIR), chat_template=str(tmp_path / "none"))])


async def test_a_template_that_does_not_parse_fails_its_requests_only(tmp_path: Path) -> None:
    prompts = PromptTokenizer([ModelConfig(name="m", tokenizer=str(tokenizer_dir(tmp_path, chat_template="{% if %}")))])
    try:
        with pytest.raises(PromptError):
            await tokenize_body(prompts, "m", "chat", {"messages": USER})
    finally:
        prompts.close()
