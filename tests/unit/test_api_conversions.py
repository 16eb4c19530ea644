"""kvgate's Messages and Responses conversions (router/apis/) against vLLM's own: the chat conversation, tools and
template options vLLM 0.32 makes of each body in tests/fixtures/api_conversions.json (written by
scripts/vllm_api_golden.py with vLLM's code), and the bodies it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.router.apis.anthropic import parse_messages
from kvgate.router.apis.responses import parse_responses
from kvgate.router.prompts.prompt import ChatPrompt, PromptError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "api_conversions.json"
CASES: dict[str, Any] = json.loads(FIXTURE.read_text())


def canonical(messages: list[dict[str, Any]]) -> str:
    """Messages compared key order aside: the chat template's conversation is rebuilt from them in vLLM's order..."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def tool_calls(messages: list[dict[str, Any]]) -> str:
    """...but for their tool calls, which reach the template as they are: key order counts."""
    return json.dumps([m.get("tool_calls") for m in messages], ensure_ascii=False)


def template_options(prompt: ChatPrompt, effort: str | None) -> dict[str, Any]:
    """The template kwargs vLLM's build_chat_params makes, from kvgate's prompt (``effort`` is the reasoning effort in
    force: the disabled-thinking effort when thinking is disabled)."""
    options: dict[str, Any] = dict(prompt.chat_template_kwargs or {})
    extra: dict[str, Any] = {"add_generation_prompt": prompt.add_generation_prompt,
                             "continue_final_message": prompt.continue_final_message, "reasoning_effort": effort}
    if prompt.documents is not None:
        extra["documents"] = prompt.documents
    if effort is not None and "enable_thinking" not in options:
        extra["enable_thinking"] = effort != "none"
    return {**options, **{k: v for k, v in extra.items() if v is not None}}


@pytest.mark.parametrize("name", sorted(CASES["messages"]))
def test_messages_bodies_become_vllms_conversation(name: str) -> None:
    case = CASES["messages"][name]
    prompt = parse_messages({"model": "m", "max_tokens": 64, **case["body"]})
    effort = "low" if prompt.thinking_disabled else prompt.reasoning_effort  # the golden's disabled-thinking effort
    assert canonical(prompt.messages) == canonical(case["in_place"]["messages"])
    assert tool_calls(prompt.messages) == tool_calls(case["in_place"]["messages"])
    merged = prompt.system_merged if prompt.system_merged is not None else prompt.messages
    assert canonical(merged) == canonical(case["merged"]["messages"])
    assert prompt.tools == case["in_place"]["tools"]  # key order too: tools reach the template as they are
    assert effort == case["in_place"]["reasoning_effort"]
    expected = {k: v for k, v in case["in_place"]["chat_template_kwargs"].items() if v is not None}
    assert template_options(prompt, effort) == expected


@pytest.mark.parametrize("name", sorted(CASES["responses"]))
def test_responses_bodies_become_vllms_conversation(name: str) -> None:
    case = CASES["responses"][name]
    prompt = parse_responses({"model": "m", **case["body"]})
    assert canonical(prompt.messages) == canonical(case["messages"])
    assert tool_calls(prompt.messages) == tool_calls(case["messages"])
    assert prompt.tools == case["tools"]
    assert prompt.add_special_tokens
    expected = {k: v for k, v in case["chat_template_kwargs"].items() if v is not None}
    assert template_options(prompt, prompt.reasoning_effort) == expected


@pytest.mark.parametrize("case", CASES["messages_refused"], ids=lambda c: c["name"])
def test_messages_bodies_vllm_refuses_are_refused(case: dict[str, Any]) -> None:
    with pytest.raises(PromptError):
        parse_messages(case["body"])


@pytest.mark.parametrize("case", CASES["responses_refused"], ids=lambda c: c["name"])
def test_responses_bodies_vllm_refuses_are_refused(case: dict[str, Any]) -> None:
    with pytest.raises(PromptError):
        parse_responses(case["body"])
