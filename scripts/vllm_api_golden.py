"""What vLLM itself makes of Anthropic Messages and OpenAI Responses bodies: the chat conversation, the tools and the
template options it renders them with, or that it refuses them. Written to tests/fixtures/api_conversions.json, which
tests/unit/test_api_conversions.py holds kvgate's own conversions (router/apis/) to.

Run with the real-engine environment's Python, which has vLLM 0.32 (scripts/engines_env.sh makes it):
    ~/.cache/kvgate/engines-venv/bin/python scripts/vllm_api_golden.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pydantic

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "api_conversions.json"

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}

MESSAGES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hello"}]},
    "system-string": {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]},
    "system-blocks-billing-cache-control": {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                   {"type": "text", "text": "You are Claude Code."},
                   {"type": "text", "text": " Tools follow.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
    "inline-system": {
        "system": "Lead.",
        "messages": [{"role": "user", "content": "one"}, {"role": "system", "content": "reminder A"},
                     {"role": "user", "content": "two"},
                     {"role": "system", "content": [{"type": "text", "text": "reminder "}, {"type": "text", "text": "B"}]},
                     {"role": "user", "content": "three"}]},
    "tool-round-trip": {
        "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris", "unit": "é"}}]},
            {"role": "user", "content": [{"type": "text", "text": "before"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                                         {"type": "text", "text": "after"}]}]},
    "tool-result-list-and-error": {
        "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}},
                                              {"type": "tool_use", "id": "t2", "name": "cat", "input": {"p": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                 "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b.txt"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": []}]}]},
    "only-tool-results": {
        "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
    "assistant-tool-result": {
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                         {"type": "text", "text": "r"}]}]}]},
    "thinking-blocks": {
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "step one ", "signature": "s"},
                                                       {"type": "thinking", "thinking": "step two"},
                                                       {"type": "redacted_thinking", "data": "xx"},
                                                       {"type": "text", "text": "answer"}]},
                     {"role": "user", "content": "more"}]},
    "empty-and-redacted-only": {
        "messages": [{"role": "user", "content": ""},
                     {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"}]},
                     {"role": "user", "content": [{"type": "text", "text": ""}]},
                     {"role": "user", "content": "end"}]},
    "effort-and-disabled-thinking": {"output_config": {"effort": "high"}, "thinking": {"type": "disabled"},
                                     "messages": [{"role": "user", "content": "q"}]},
    "effort-only": {"output_config": {"effort": "low"}, "messages": [{"role": "user", "content": "q"}]},
    "tools-defaults": {
        "tools": [{"name": "a", "input_schema": {"properties": {"x": {"type": "string"}}}},
                  {"name": "b", "description": "d", "input_schema": {"type": "object"}, "strict": True,
                   "defer_loading": True}],
        "tool_choice": {"type": "none"}, "messages": [{"role": "user", "content": "q"}]},
    "tool-changes": {
        "tools": [TOOL, {"name": "old", "input_schema": {"type": "object"}, "defer_loading": True}],
        "messages": [{"role": "system", "content": [
                         {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "old"}},
                         {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
                         {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                             "name": "new", "input_schema": {"type": "object"}}}}]},
                     {"role": "user", "content": "q"}]},
    "image": {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "text", "text": "what is this"}]}]},
}
MESSAGES_INVALID: dict[str, dict[str, Any]] = {
    "document-block": {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    "bad-role": {"messages": [{"role": "tool", "content": "x"}]},
    "no-max-tokens": {"max_tokens": None, "messages": [{"role": "user", "content": "x"}]},
    "zero-max-tokens": {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
    "too-many-stops": {"stop_sequences": ["a", "b", "c", "d", "e"], "messages": [{"role": "user", "content": "x"}]},
    "tool-without-schema": {"tools": [{"name": "a"}], "messages": [{"role": "user", "content": "x"}]},
    "tool-choice-tool-without-name": {"tool_choice": {"type": "tool"}, "messages": [{"role": "user", "content": "x"}]},
    "thinking-budget-too-small": {"thinking": {"type": "enabled", "budget_tokens": 10},
                                  "messages": [{"role": "user", "content": "x"}]},
    "thinking-budget-over-max": {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 4000},
                                 "messages": [{"role": "user", "content": "x"}]},
    "tool-change-in-user": {"messages": [{"role": "user", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}]}]},
    "content-number": {"messages": [{"role": "user", "content": 5}]},
    "text-number": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
}

RESPONSES: dict[str, dict[str, Any]] = {
    "string": {"input": "Hello"},
    "instructions-developer": {"instructions": "Be brief.",
                               "input": [{"role": "developer", "content": "Dev says"},
                                         {"role": "user", "content": "Hi"}]},
    "message-items": {"input": [{"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": "part one"},
                                             {"type": "input_text", "text": "part two"}]}]},
    "tool-round-trip": {
        "tools": [FUNCTION],
        "input": [{"role": "user", "content": "Weather?"},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}],
                   "content": [{"type": "reasoning_text", "text": "think"}]},
                  {"type": "message", "role": "assistant", "content": [
                      {"type": "output_text", "text": "o1"}, {"type": "output_text", "text": "o2"}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                  {"type": "function_call_output", "call_id": "c2", "output": "sun"}]},
    "reasoning-summary-only": {"input": [{"role": "user", "content": "q"},
                                         {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                                         {"type": "reasoning", "summary": []}]},
    "assistant-string": {"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                   {"type": "message", "role": "assistant", "content": "b"}]},
    "continue-partial": {"input": [{"role": "user", "content": "q"},
                                   {"type": "message", "role": "assistant", "status": "in_progress",
                                    "content": [{"type": "output_text", "text": "The answer is"}]}]},
    "namespace-and-custom-tools": {
        "tools": [{"type": "namespace", "name": "fs", "description": "files",
                   "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]},
                  {"type": "custom", "name": "patch", "description": "apply a patch"},
                  {"type": "web_search"}],
        "input": [{"role": "user", "content": "q"},
                  {"type": "function_call", "call_id": "c1", "namespace": "fs", "name": "read", "arguments": "{}"},
                  {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "diff ü"},
                  {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"}]},
    "reasoning-effort": {"reasoning": {"effort": "low"}, "input": "q"},
    "system-items": {"input": [{"role": "system", "content": "S1"}, {"role": "user", "content": "u"},
                               {"role": "system", "content": [{"type": "input_text", "text": "S2"}]}]},
}
RESPONSES_INVALID: dict[str, dict[str, Any]] = {
    "item-reference": {"input": [{"type": "item_reference", "id": "msg_1"}]},
    "encrypted-reasoning": {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zzz"}]},
    "prompt-template": {"input": "q", "prompt": {"id": "pmpt_1"}},
    "function-call-without-arguments": {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
    "input-number": {"input": 5},
}


def anthropic_case(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    request = AnthropicMessagesRequest(**{"model": "m", "max_tokens": 64, **body})
    out: dict[str, Any] = {}
    for merge in (False, True):
        chat = AnthropicServingMessages.to_chat_completion_request(
            request, merge_inline_system=merge, disabled_thinking_effort="low")
        params = chat.build_chat_params(None, "auto")
        out["merged" if merge else "in_place"] = {
            "messages": chat.messages,
            "tools": [t.model_dump() for t in chat.tools] if chat.tools is not None else None,
            "reasoning_effort": chat.reasoning_effort,
            "chat_template_kwargs": params.chat_template_kwargs,
        }
    return out


def responses_case(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    request = ResponsesRequest(**{"model": "m", **body})
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    params = request.build_chat_params(None, "auto")
    return {"messages": messages, "tools": construct_tool_dicts(request.tools, request.tool_choice),
            "chat_template_kwargs": params.chat_template_kwargs}


def refused(convert: Any, body: dict[str, Any]) -> bool:
    from vllm.exceptions import VLLMValidationError

    try:
        convert(body)
    except (pydantic.ValidationError, VLLMValidationError, ValueError, TypeError):
        return True
    return False


def main() -> int:
    cases: dict[str, Any] = {"messages": {}, "responses": {}, "messages_refused": [], "responses_refused": []}
    for name, body in MESSAGES.items():
        cases["messages"][name] = {"body": body, **anthropic_case(body)}
    for name, body in RESPONSES.items():
        cases["responses"][name] = {"body": body, **responses_case(body)}
    for name, body in MESSAGES_INVALID.items():
        full = {"model": "m", "max_tokens": 64, **body}
        if not refused(anthropic_case, {k: v for k, v in full.items() if k != "model"}):
            print(f"vLLM accepts the Messages body {name!r}", file=sys.stderr)
            return 1
        cases["messages_refused"].append({"name": name, "body": full})
    for name, body in RESPONSES_INVALID.items():
        if not refused(responses_case, body):
            print(f"vLLM accepts the Responses body {name!r}", file=sys.stderr)
            return 1
        cases["responses_refused"].append({"name": name, "body": {"model": "m", **body}})
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False, default=lambda o: o.model_dump()) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
