"""vLLM 0.32's Anthropic Messages API (``vllm/entrypoints/anthropic/``): the request model's checks, the chat
conversation vLLM turns a Messages request into, the answer (a message, or its SSE events), count_tokens' answer,
and the Anthropic-shaped errors its handler returns.

vLLM serves ``/v1/messages`` by converting the request into a chat completions request
(``AnthropicServingMessages.to_chat_completion_request``) and running it as one, so the prompt, the prefix cache and
the generation are the chat endpoint's. What is particular to Messages is here: the system blocks joined without a
separator, inline system messages kept in place or merged into the leading one (a probe of the template decides),
tool results pulled ahead of the user text they came with, thinking blocks as the assistant's reasoning, a disabled
thinking mapped to the effort a second probe of the template picks, and the answer's events and usage.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from .answers import cache_creation_tokens, named_sse
from .bodies import field, literal
from .checks import check_cache_salt, check_model, check_output_request, check_prompt_len, output_budget
from .conversation import Conversation, prompt_ids, render_text, tool_dicts
from .engine import SimRequest
from .errors import BodyError, EngineError
from .model import SimModel
from .tokenizer import BILLING_HEADER

ROLES = ("user", "assistant", "system")
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
               "tool_addition", "tool_removal")
TOOL_CHANGES = ("tool_addition", "tool_removal")
BLOCK_FIELDS: dict[str, tuple[type, ...]] = {
    "text": (str,), "source": (dict,), "id": (str,), "tool_use_id": (str,), "name": (str,), "input": (dict,),
    "content": (str, list), "is_error": (bool,), "tool_name": (str,), "thinking": (str,), "signature": (str,),
    "data": (str,), "tool": (dict,),
}
"""``AnthropicContentBlock``'s optional fields and their types."""
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
THINKING_DISPLAYS = ("summarized", "omitted", "updates")
MIN_THINKING_BUDGET = 1024
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
MAX_STOP_SEQUENCES = 4
"""``VLLM_MAX_STOP_STRINGS``'s default."""
CACHE_SALT_MAX_CHARS = 1024
"""The request model's own bound; vLLM's 128-character rule comes later, from the chat request it builds."""
PROBE_MESSAGES = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                  {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]
STOP_REASON = "max_tokens"
"""The sim generates until ``max_tokens`` (finish reason ``length``)."""


class AnthropicError(EngineError):
    """An error vLLM's Messages handler returns: ``{"type": "error", "error": {"type", "message"}}`` with vLLM's own
    type names (``BadRequestError``, ``NotFoundError``, ...) and the error's status. A body the request model
    refuses is not one of these: it stays a :class:`loadgen.sim.errors.BodyError`."""

    @classmethod
    def of(cls, err: EngineError) -> AnthropicError:
        return cls(err.message, err.param, err.status, err.kind)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


# --- the request models ------------------------------------------------------------------------------------------
def check_request(body: dict[str, Any], count_tokens: bool = False) -> None:
    """``AnthropicMessagesRequest`` (or ``AnthropicCountTokensRequest``, which has no ``max_tokens``, stream or
    sampling fields): the fields' types and their validators. Unknown fields are ignored, as pydantic does."""
    model = field(body, "model", (str,), required=True)
    if not model:
        raise BodyError("model", "Value error, Model is required")
    messages = field(body, "messages", (list,), required=True)
    for i, message in enumerate(messages):
        _check_message(message, f"messages.{i}")
    system = field(body, "system", (str, list))
    if isinstance(system, list):
        _check_blocks(system, "system")
        _reject_tool_changes(system, "system")
    _check_output_config(field(body, "output_config", (dict,)))
    thinking = _check_thinking(field(body, "thinking", (dict,)))
    _check_tool_choice(field(body, "tool_choice", (dict,)))
    for i, tool in enumerate(field(body, "tools", (list,)) or []):
        _check_tool(tool, f"tools.{i}")
    field(body, "chat_template_kwargs", (dict,))
    if count_tokens:
        return
    max_tokens = field(body, "max_tokens", (int,), required=True)
    if max_tokens <= 0:
        raise BodyError("max_tokens", "Value error, max_tokens must be positive")
    field(body, "metadata", (dict,))
    stops = field(body, "stop_sequences", (list,))
    if stops is not None and not all(isinstance(s, str) for s in stops):
        raise BodyError("stop_sequences", "Input should be a valid string")
    if stops is not None and len(stops) > MAX_STOP_SEQUENCES:
        raise BodyError("stop_sequences",
                        f"List should have at most {MAX_STOP_SEQUENCES} items after validation, not {len(stops)}")
    field(body, "stream", (bool,))
    for name in ("temperature", "top_p"):
        field(body, name, (int, float))
    field(body, "top_k", (int,))
    salt = field(body, "cache_salt", (str,))
    if salt is not None and not 1 <= len(salt) <= CACHE_SALT_MAX_CHARS:
        raise BodyError("cache_salt", f"String should have between 1 and {CACHE_SALT_MAX_CHARS} characters")
    transfer = field(body, "kv_transfer_params", (dict,))
    for name in ("ec_transfer_params", "vllm_xargs"):
        field(body, name, (dict,))
    remote_decode = bool(transfer and transfer.get("do_remote_decode"))
    if thinking is not None and thinking["type"] == "enabled" and not remote_decode \
            and thinking["budget_tokens"] >= max_tokens:
        raise BodyError("", "Value error, thinking.budget_tokens must be less than max_tokens")


def _check_message(message: Any, loc: str) -> None:
    if not isinstance(message, dict):
        raise BodyError(loc, "Input should be a valid dictionary")
    literal(message.get("role"), ROLES, f"{loc}.role")
    content = field(message, "content", (str, list), required=True, at=loc)
    if isinstance(content, list):
        _check_blocks(content, f"{loc}.content")
        if message["role"] != "system":
            _reject_tool_changes(content, loc)


def _reject_tool_changes(blocks: list[dict[str, Any]], loc: str) -> None:
    """Tools change only in a system message (inline, in ``messages``), never in ``system`` or another turn."""
    change = next((b["type"] for b in blocks if b["type"] in TOOL_CHANGES), None)
    if change is not None:
        raise BodyError(loc, f'Value error, {change} blocks are only allowed in messages with role "system"')


def _check_blocks(blocks: list[Any], loc: str) -> None:
    for i, block in enumerate(blocks):
        at = f"{loc}.{i}"
        if not isinstance(block, dict):
            raise BodyError(at, "Input should be a valid dictionary")
        literal(block.get("type"), BLOCK_TYPES, f"{at}.type")
        for name, kinds in BLOCK_FIELDS.items():
            field(block, name, kinds, at=at)
        content = block.get("content")
        if isinstance(content, list) and not all(isinstance(item, dict) for item in content):
            raise BodyError(f"{at}.content", "Input should be a valid dictionary")
        if block["type"] in TOOL_CHANGES:
            _check_tool_change(block, at)


def _check_tool_change(block: dict[str, Any], loc: str) -> None:
    """``AnthropicToolChange``: a tool by reference (``tool_reference``) or by value (``tool_definition``)."""
    change = block.get("tool")
    if change is None:
        raise BodyError(loc, f"Value error, tool is required for {block['type']} blocks")
    literal(change.get("type"), ("tool_reference", "tool_definition"), f"{loc}.tool.type")
    if change["type"] == "tool_reference":
        field(change, "name", (str,), required=True, at=f"{loc}.tool")
    else:
        _check_tool(field(change, "definition", (dict,), required=True, at=f"{loc}.tool"), f"{loc}.tool.definition")
    if block["type"] == "tool_removal" and change["type"] != "tool_reference":
        raise BodyError(loc, "Value error, tool_removal only accepts a tool_reference")


def _check_tool(tool: Any, loc: str) -> None:
    """``AnthropicTool``; its validator gives an ``input_schema`` without ``type`` a ``"type": "object"``, appended
    after the schema's own keys (so a template's ``tojson`` shows it last)."""
    if not isinstance(tool, dict):
        raise BodyError(loc, "Input should be a valid dictionary")
    field(tool, "name", (str,), required=True, at=loc)
    field(tool, "description", (str,), at=loc)
    schema = field(tool, "input_schema", (dict,), required=True, at=loc)
    for name in ("strict", "defer_loading"):
        field(tool, name, (bool,), at=loc)
    if "type" not in schema:
        schema["type"] = "object"


def _check_output_config(config: dict[str, Any] | None) -> None:
    if config is None:
        return
    if config.get("effort") is not None:
        literal(config["effort"], EFFORTS, "output_config.effort")
    form = field(config, "format", (dict,), at="output_config")
    if form is not None:
        literal(form.get("type", "json_schema"), ("json_schema",), "output_config.format.type")
        field(form, "schema", (dict,), at="output_config.format")


def _check_thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    if thinking is None:
        return None
    literal(thinking.get("type"), THINKING_TYPES, "thinking.type")
    if thinking.get("display") is not None and thinking["type"] != "disabled":
        literal(thinking["display"], THINKING_DISPLAYS, f"thinking.{thinking['type']}.display")
    if thinking["type"] == "enabled":
        budget = field(thinking, "budget_tokens", (int,), required=True, at="thinking.enabled")
        if budget < MIN_THINKING_BUDGET:
            raise BodyError("thinking.enabled.budget_tokens",
                            f"Input should be greater than or equal to {MIN_THINKING_BUDGET}")
    return thinking


def _check_tool_choice(choice: dict[str, Any] | None) -> None:
    if choice is None:
        return
    literal(choice.get("type"), TOOL_CHOICE_TYPES, "tool_choice.type")
    name = field(choice, "name", (str,), at="tool_choice")
    field(choice, "disable_parallel_tool_use", (bool,), at="tool_choice")
    if choice["type"] == "tool" and not name:
        raise BodyError("tool_choice", "Value error, tool_choice.name is required when type is 'tool'")


# --- the conversion ----------------------------------------------------------------------------------------------
class MessagesApi:
    """One replica's Messages endpoints over its model. What vLLM's handler learns of the chat template by rendering
    it is learnt here the same way: whether inline system messages must be merged into the leading one (probed
    once, at start), and the effort a disabled thinking maps to (probed at the first request that disables it)."""

    def __init__(self, model: SimModel, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = block_size
        template = model.tokenizer.chat_template
        self.merge_inline_system = merges_inline_system(None if template is None else template.source)
        self._disabled_thinking_effort: str | None = None

    def prompt(self, body: dict[str, Any], count_tokens: bool = False) -> list[int]:
        """The prompt's ids, in the order vLLM checks a checked body: the chat request's ``cache_salt``, the
        model, the output budget's bound, the rendering and the prompt's length."""
        if not count_tokens:
            check_cache_salt(body.get("cache_salt"))
        check_model(body, self.model.name)
        if not count_tokens:
            check_output_request(body["max_tokens"], self.max_model_len, "max_completion_tokens")
        ids = prompt_ids(self.model.tokenizer, self.conversation(body))
        check_prompt_len(len(ids), self.max_model_len)
        return ids

    def generation_options(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """``_build_base_request``'s fields that steer the generation, in the chat request's names, with the
        output budget vLLM leaves the prompt."""
        max_tokens = output_budget(prompt_len, body["max_tokens"], self.max_model_len)
        return {"max_tokens": max_tokens, "stream": bool(body.get("stream")), "cache_salt": body.get("cache_salt"),
                "kv_transfer_params": body.get("kv_transfer_params"), "vllm_xargs": body.get("vllm_xargs")}

    def answer(self, request_id: str) -> MessagesAnswer:
        return MessagesAnswer(request_id, self.model, self.block_size)

    def conversation(self, body: dict[str, Any]) -> Conversation:
        """``to_chat_completion_request``'s chat request, as far as the prompt goes."""
        effort = (body.get("output_config") or {}).get("effort")
        thinking = body.get("thinking")
        if thinking is not None and thinking["type"] == "disabled":
            effort = self.disabled_thinking_effort()  # after output_config: a disabled thinking overrides its effort
        tools = _resolved_tools(body)
        return Conversation(
            messages=chat_messages(body, self.merge_inline_system),
            tools=tool_dicts(None if tools is None else [_chat_tool(t) for t in tools]),
            chat_template_kwargs=body.get("chat_template_kwargs"),
            reasoning_effort=effort,
        )

    def disabled_thinking_effort(self) -> str:
        """``_probe_disabled_thinking_effort``: ``"none"``, unless the template refuses it or renders it as it
        renders one of the real efforts (a template that ignores the effort does), then ``"low"``."""
        if self._disabled_thinking_effort is None:
            none = self._probe_render("none")
            same = none is None or any(self._probe_render(effort) == none for effort in EFFORTS)
            self._disabled_thinking_effort = "low" if same else "none"
        return self._disabled_thinking_effort

    def _probe_render(self, effort: str) -> str | None:
        probe = Conversation([{"role": "user", "content": "Hi"}], reasoning_effort=effort)
        try:
            return render_text(self.model.tokenizer, probe)
        except EngineError:
            return None


def merges_inline_system(source: str | None) -> bool:
    """``_detect_merge_inline_system``: a template that fails on ``[system, user, system, user]`` in a bare
    sandbox (no ``raise_exception``, ``strftime_now``, ``{% generation %}``, special tokens or tools, so a template
    that calls one of those fails too) needs inline system messages merged; so does no template at all. vLLM asks
    this of the template with and without tools; the sim's model has one template for both."""
    if not source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(source).render(messages=PROBE_MESSAGES, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def chat_messages(body: dict[str, Any], merge_inline_system: bool) -> list[dict[str, Any]]:
    """``_convert_system_message`` then ``_convert_messages``: the OpenAI-format messages vLLM renders."""
    messages: list[dict[str, Any]] = []
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += [b["text"] for b in system if b["type"] == "text" and b.get("text")
                  and not b["text"].startswith(BILLING_HEADER)]
    if merge_inline_system:
        parts += [t for m in body["messages"] if m["role"] == "system" and (t := _system_text(m))]
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for message in body["messages"]:
        role = message["role"]
        if role == "system":
            text = None if merge_inline_system else _system_text(message)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(message["content"], str):
            converted["content"] = message["content"]
        else:
            _convert_blocks(message["content"], converted, messages)
        if role == "assistant" or "content" in converted:  # a user turn of tool results only leaves no user message
            messages.append(converted)
    return messages


def _system_text(message: dict[str, Any]) -> str | None:
    """``_extract_system_text``: a system message's text blocks joined without a separator, the billing header's
    left out (a string content that starts with it is dropped whole)."""
    content = message["content"]
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = [b["text"] for b in content if b["type"] == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(texts) or None


def _convert_blocks(blocks: list[dict[str, Any]], converted: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """``_convert_message_content``: text and image blocks become content parts, thinking blocks the reasoning,
    tool_use blocks tool calls; a user's tool_result blocks become tool messages, appended as they are met, so
    ahead of the user message that carries the turn's text."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})  # Python's default separators and ASCII escapes
            calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.get("name") or "", "arguments": arguments}})
        elif kind == "tool_result" and converted["role"] == "user":
            messages.extend(_tool_result_messages(block))
        elif kind == "tool_result":
            text = str(block["content"]) if block.get("content") else ""  # a list shows as Python's repr, as in vLLM
            parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _tool_result_messages(block: dict[str, Any]) -> list[dict[str, Any]]:
    """``_convert_user_tool_result``: the tool message (text items joined with ``"\\n"``; ``is_error`` is not
    shown), then a user message with its images and a tool message with its tool references, if it has any."""
    call_id = block.get("tool_use_id") or ""
    content = block.get("content")
    texts: list[str] = []
    images: list[str] = []
    references: list[dict[str, Any]] = []
    for item in content if isinstance(content, list) else []:
        kind = item.get("type")
        if kind == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise EngineError("sequence item: expected str instance in a tool_result's text")
            texts.append(text)
        elif kind == "image" and (url := _image_url(item.get("source", {}))):
            images.append(url)
        elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
            references.append({"type": "tool_reference", "name": name})
    text = content if isinstance(content, str) else "\n".join(texts)
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _image_url(source: dict[str, Any]) -> str:
    """``_convert_image_source_to_url``: a URL source's URL, else a base64 data URI."""
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _resolved_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``_resolve_tools``: the request's tools as the conversation's tool_addition and tool_removal blocks leave
    them (a tool added by reference is no longer deferred, one added by value is declared, a removed one dropped)."""
    changes = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b["type"] in TOOL_CHANGES]
    if not changes:
        return body.get("tools")
    tools = {tool["name"]: tool for tool in body.get("tools") or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            if name not in tools:
                raise EngineError(f"{block['type']} references tool {name!r}, which is not declared in tools")
            if block["type"] == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """``_convert_tools``: an Anthropic tool as the chat request's function tool."""
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description"), "parameters": tool["input_schema"],
        "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading"),
    }}


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}


# --- the answer --------------------------------------------------------------------------------------------------
class MessagesAnswer:
    """A message (``messages_full_converter``, dumped without nulls), or its events (``message_stream_converter``):
    ``message_start`` with the whole prompt as ``input_tokens``, then ``content_block_start`` and the text deltas,
    both at the first token (vLLM builds them from the chat stream's first chunk, which comes with the first token),
    then ``content_block_stop``, ``message_delta`` with the stop reason and the usage, and ``message_stop``; no
    ``ping``, no ``[DONE]``. The id is the chat completion's (``chatcmpl-`` and the X-Request-Id or a random id)."""

    def __init__(self, request_id: str, model: SimModel, block_size: int) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.block_size = block_size

    def usage(self, req: SimRequest) -> dict[str, int]:
        """``_build_anthropic_usage``: ``input_tokens`` are the prompt tokens neither read from the cache nor
        written to it (vLLM's server runs with ``--enable-prompt-tokens-details``, so the cache fields are there)."""
        created = cache_creation_tokens(req, self.block_size)
        return {"input_tokens": max(0, req.prompt_len - req.cached_tokens - created),
                "output_tokens": len(req.output), "cache_creation_input_tokens": created,
                "cache_read_input_tokens": req.cached_tokens}

    def body(self, req: SimRequest) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": self.model.text(req.output)}], "model": self.model.name,
            "stop_reason": STOP_REASON, "usage": self.usage(req),
        }
        if req.kv_transfer_params_out is not None:
            out["kv_transfer_params"] = req.kv_transfer_params_out
        return out

    def opening(self) -> bytes:
        return b""

    def first(self, req: SimRequest) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model.name,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": req.prompt_len, "output_tokens": 0}}
        return (named_sse("message_start", {"type": "message_start", "message": message})
                + named_sse("content_block_start", {"type": "content_block_start",
                                                    "content_block": {"type": "text", "text": ""}, "index": 0}))

    def token(self, req: SimRequest, token_id: int, last: bool) -> bytes:
        return named_sse("content_block_delta", {
            "type": "content_block_delta", "delta": {"type": "text_delta", "text": self.model.token_text[token_id]},
            "index": 0})

    def closing(self, req: SimRequest) -> bytes:
        return (named_sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                + named_sse("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": STOP_REASON, "stop_sequence": None},
                                              "usage": self.usage(req)})
                + named_sse("message_stop", {"type": "message_stop"}))
