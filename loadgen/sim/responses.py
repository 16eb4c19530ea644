"""vLLM 0.32's OpenAI Responses API (``vllm/entrypoints/openai/responses/``), non-Harmony path: the request model's
checks, the chat conversation an input becomes (``construct_input_messages``), the in-process store behind
``previous_response_id``, ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, and the answer (a
response object, or its SSE events).

vLLM renders a Responses input as a chat: ``instructions`` as a leading system message, a stored previous turn's
messages (its system messages left out) and its output messages, then the input items, a reasoning item, an
assistant message and function calls that follow each other merged into one assistant message. The template is
the chat one, encoded with the BOS post-processor (``add_special_tokens``). Responses are kept only when the server
runs with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, in the process, never evicted; otherwise ``store`` is ignored and
every previous response is unknown.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from .answers import cache_creation_tokens, named_sse
from .bodies import field, literal
from .checks import check_cache_salt, check_model, check_output_request, check_prompt_len, output_budget
from .conversation import Conversation, prompt_ids, tool_dicts
from .engine import SimRequest
from .errors import BodyError, EngineError
from .ids import random_id
from .model import SimModel

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
TRUNCATIONS = ("auto", "disabled")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
TOOL_CHOICES = ("auto", "none", "required")
INCLUDES = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
            "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
BUILTIN_TOOLS = ("file_search", "computer", "computer_use_preview", "web_search", "web_search_preview", "mcp",
                 "code_interpreter", "programmatic_tool_calling", "image_generation", "local_shell", "shell",
                 "tool_search", "apply_patch", "web_search_2025_08_26", "web_search_preview_2025_03_11")
"""Tool types the request model takes that the template never sees."""
FUNCTION_TOOL_FIELDS = ("name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading",
                        "description", "output_schema")
"""openai's ``FunctionTool`` fields, in the order a response echoes them."""
REASONING_FIELDS = ("context", "effort", "generate_summary", "mode", "summary")
"""openai's ``Reasoning`` fields, in the order a response echoes them."""
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        CUSTOM_TOOL_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."},
    },
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}
"""The single-string function a ``custom`` tool is shown to the template as (``custom_tool_parameters``)."""
ITEM_FIELDS = {"function_call": ("call_id", "name", "arguments"), "custom_tool_call": ("call_id", "name"),
               "function_call_output": ("call_id", "output"), "custom_tool_call_output": ("call_id", "output"),
               "reasoning": ("summary",)}
"""The fields an input item of each type requires; an item of another type with a ``role`` requires ``content``."""
PARTIAL_STATUSES = ("in_progress", "incomplete")


def store_enabled(environ: dict[str, str]) -> bool:
    """vLLM's reading of ``VLLM_ENABLE_RESPONSES_API_STORE``: an integer, true when not 0."""
    return bool(int(environ.get(STORE_ENV, "0")))


# --- the request model -------------------------------------------------------------------------------------------
def check_request(body: dict[str, Any]) -> None:
    """``ResponsesRequest``: the fields' types (unknown fields are accepted and ignored), then its "before"
    validators (``cache_salt``, ``background``, ``prompt``, ``tool_choice`` against ``tools``). A type error is a
    :class:`loadgen.sim.errors.BodyError`; a validator's error is vLLM's ``VLLMValidationError``, a 400
    ``BadRequestError`` naming its parameter."""
    items = body.get("input")
    if items is None:
        raise BodyError("input", "Field required")
    if not isinstance(items, (str, list)):
        raise BodyError("input", "Input should be a valid string")
    for i, item in enumerate(items if isinstance(items, list) else []):
        _check_item(item, f"input.{i}")
    for name, kinds in (("instructions", (str,)), ("model", (str,)), ("previous_response_id", (str,)),
                        ("user", (str,)), ("session_id", (str,)), ("request_id", (str,)), ("metadata", (dict,)),
                        ("reasoning", (dict,)), ("text", (dict,)), ("kv_transfer_params", (dict,)),
                        ("vllm_xargs", (dict,)), ("chat_template_kwargs", (dict,)), ("tools", (list,)),
                        ("include", (list,)), ("max_output_tokens", (int,)), ("max_tool_calls", (int,)),
                        ("top_logprobs", (int,)), ("top_k", (int,)), ("store", (bool,)), ("stream", (bool,)),
                        ("background", (bool,)), ("parallel_tool_calls", (bool,)), ("temperature", (int, float)),
                        ("top_p", (int, float)), ("presence_penalty", (int, float)),
                        ("frequency_penalty", (int, float))):
        field(body, name, kinds)
    effort = (body.get("reasoning") or {}).get("effort")
    literal(effort, (None, *EFFORTS), "reasoning.effort")
    literal(body.get("truncation"), (None, *TRUNCATIONS), "truncation")
    literal(body.get("service_tier", "auto"), SERVICE_TIERS, "service_tier")
    for i, include in enumerate(body.get("include") or []):
        literal(include, INCLUDES, f"include.{i}")
    for i, tool in enumerate(body.get("tools") or []):
        _check_tool(tool, f"tools.{i}")
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, str):
        literal(choice, TOOL_CHOICES, "tool_choice")
    elif not isinstance(choice, dict):
        raise BodyError("tool_choice", "Input should be 'auto', 'none' or 'required'")
    check_cache_salt(body.get("cache_salt"))
    if body.get("background") and not body.get("store", True):
        raise EngineError("background can only be used when `store` is true (parameter=background)", "background")
    if body.get("prompt") is not None:
        raise EngineError("prompt template is not supported (parameter=prompt)", "prompt")
    _check_tool_choice(choice, body.get("tools") or [])


def _check_item(item: Any, loc: str) -> None:
    """The fields an input item's model requires (the items vLLM parses into output-item models included)."""
    if not isinstance(item, dict):
        raise BodyError(loc, "Input should be a valid dictionary")
    kind = item.get("type")
    for name in ITEM_FIELDS.get(kind, ("content",) if "role" in item else ()):
        if item.get(name) is None:
            raise BodyError(f"{loc}.{name}", "Field required")
    if kind == "function_call":
        field(item, "arguments", (str,), at=loc)
    if kind == "reasoning":  # every summary and content part carries its text
        parts = field(item, "summary", (list,), at=loc) + (field(item, "content", (list,), at=loc) or [])
        if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts):
            raise BodyError(f"{loc}.content", "Input should be a list of parts with a text")
    elif isinstance(item.get("content"), list) and not all(isinstance(part, dict) for part in item["content"]):
        raise BodyError(f"{loc}.content", "Input should be a valid dictionary")


def _check_tool(tool: Any, loc: str) -> None:
    if not isinstance(tool, dict):
        raise BodyError(loc, "Input should be a valid dictionary")
    kind = tool.get("type")
    if kind in ("function", "custom", "namespace"):
        if not isinstance(tool.get("name"), str):
            raise BodyError(f"{loc}.{kind}.name", "Field required")
        if kind == "function" and not isinstance(tool.get("parameters") or {}, dict):
            raise BodyError(f"{loc}.function.parameters", "Input should be a valid dictionary")
        if kind == "namespace":
            for i, inner in enumerate(tool.get("tools") or []):
                _check_tool(inner, f"{loc}.namespace.tools.{i}")
        if kind == "custom" and (tool.get("format") or {}).get("type") == "grammar":
            raise EngineError("Custom tools with a grammar format are not supported; only free-form text custom "
                              "tools are accepted. (parameter=tools)", "tools")
    elif kind not in BUILTIN_TOOLS:
        raise BodyError(f"{loc}.type", "Input tag does not match any of the expected tool types")


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> None:
    """``check_tool_usage``: without tools only ``auto`` and ``none`` go (both become ``none``, see
    :func:`resolved_tool_choice`); a named tool must be one of the tools."""
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice == "required":
            raise EngineError("Tool choice 'required' must be specified with 'tools' parameter. "
                              "(parameter=tool_choice)", "tool_choice")
        if named:
            raise EngineError("Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)",
                              "tool_choice")
    elif named:
        resolved_tool_choice(choice, tools)


def resolved_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    """The ``tool_choice`` the response echoes: ``none`` when there are no tools, a named tool under its flat
    ``<namespace>__<name>`` name when only a namespace defines it (``_resolve_named_tool_choice``)."""
    if not tools:
        return "none"
    if not (isinstance(choice, dict) and choice.get("type") in ("function", "custom")):
        return choice
    name = choice.get("name")
    exact = {t["name"] for t in tools if t.get("type") != "namespace" and isinstance(t.get("name"), str)}
    local: dict[str, list[str]] = {}
    for tool in (t for t in tools if t.get("type") == "namespace"):
        for inner in (t for t in tool.get("tools") or [] if isinstance(t.get("name"), str)):
            flat = f"{tool['name']}{NAMESPACE_SEPARATOR}{inner['name']}"
            exact.add(flat)
            local.setdefault(inner["name"], []).append(flat)
    if name in exact:
        return _named(choice, name)
    candidates = local.get(name, []) if isinstance(name, str) else []
    if len(candidates) > 1:
        raise EngineError(f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                          f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name. "
                          "(parameter=tool_choice)", "tool_choice")
    if not candidates:
        raise EngineError("Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)",
                          "tool_choice")
    return _named(choice, candidates[0])


def _named(choice: dict[str, Any], name: str) -> dict[str, Any]:
    """A named tool choice as openai's ``ToolChoiceFunction`` (or ``ToolChoiceCustom``) dumps it: name, then type."""
    return {"name": name, "type": choice["type"], **{k: v for k, v in choice.items() if k not in ("name", "type")}}


# --- the conversation --------------------------------------------------------------------------------------------
def input_messages(body: dict[str, Any], history: list[dict[str, Any]] | None,
                   previous_output: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``construct_input_messages``: ``instructions``, the previous turn's messages less its system messages
    (instructions do not carry over) and its output messages, one assistant message per content part (its
    reasoning and function calls are not carried over), then the input."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += [m for m in history or [] if m.get("role") != "system"]
    for item in previous_output or []:
        if item["type"] == "message":
            messages += [{"role": "assistant", "content": part["text"]} for part in item["content"]]
    items = body["input"]
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    converted: list[dict[str, Any]] = []
    for item in items:
        message = _from_item(item, converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    return messages + converted


def _from_item(item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """``_construct_message_from_response_item``: the message an input item becomes, or None when it was merged
    into the assistant message before it (a function call joins its tool calls, a reasoning item its missing
    reasoning, an assistant message its missing content; only an assistant message's first part counts)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    call = _tool_call(item)
    if call is not None:
        calls = None if assistant is None else assistant.get("tool_calls")
        if assistant is None or not isinstance(calls, (list, type(None))):
            return {"role": "assistant", "tool_calls": [call]}
        assistant["tool_calls"] = [*(calls or []), call]
        return None
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise EngineError("Encrypted content is not supported. (parameter=input)", "input")
        content, summary = item.get("content"), item["summary"]
        text = content[0]["text"] if content else summary[0]["text"] if summary else ""
        return _merged(assistant, "reasoning", text)
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else content[0].get("text") if content else None
        if text is not None:
            return _merged(assistant, "content", text)
    if "role" in item:
        return item
    raise EngineError(f"Unsupported input item type: {kind} (parameter=input)", "input")


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A function call item (its name flattened under its namespace) or a custom tool call (its input wrapped as
    the single argument of its function shim) as a chat tool call; None for any other item."""
    if item.get("type") == "function_call":
        name = item["name"] if not item.get("namespace") else f"{item['namespace']}{NAMESPACE_SEPARATOR}{item['name']}"
        return {"id": item["call_id"], "function": {"name": name, "arguments": item["arguments"]}, "type": "function"}
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
        return {"id": item["call_id"], "function": {"name": item["name"], "arguments": arguments}, "type": "function"}
    return None


def _merged(assistant: dict[str, Any] | None, key: str, value: str) -> dict[str, Any] | None:
    """``value`` set on the assistant message before, if that has no ``key`` yet; else a new assistant message."""
    if assistant is not None and assistant.get(key) is None:
        assistant[key] = value
        return None
    return {"role": "assistant", key: value}


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``construct_tool_dicts``: the function tools the template is shown (``get_function_tools``: a namespace's
    functions under their flat names, a custom tool as its single-string function, no built-in tool), as chat
    tools; None when the request has none."""
    if not tools:
        return None
    functions: list[dict[str, Any]] = []
    for tool in tools:
        if tool["type"] == "function":
            functions.append(tool)
        elif tool["type"] == "namespace":
            functions += [{**inner, "name": f"{tool['name']}{NAMESPACE_SEPARATOR}{inner['name']}"}
                          for inner in tool.get("tools") or [] if inner.get("type") == "function"]
        elif tool["type"] == "custom":
            functions.append({"type": "function", "name": tool["name"], "description": tool.get("description"),
                              "parameters": CUSTOM_TOOL_PARAMETERS})
    return tool_dicts([{"type": "function", "function": {k: v for k, v in f.items() if k != "type"}}
                       for f in functions])


def continues_final_message(items: str | list[dict[str, Any]]) -> bool:
    """``should_continue_final_message``: the input ends with a message or reasoning item still in progress (or
    incomplete), which the model continues instead of starting a new assistant turn."""
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in PARTIAL_STATUSES


# --- the store and the turns -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """One ``POST /v1/responses`` once checked and rendered: its prompt, the chat-request fields that steer its
    generation, the messages a later turn's ``previous_response_id`` brings back, and what its answer echoes."""

    response_id: str
    prompt_ids: list[int]
    options: dict[str, Any]
    messages: list[dict[str, Any]]
    max_tokens: int
    tool_choice: Any
    store: bool


class ResponsesApi:
    """One replica's Responses endpoints over its model, and its store (``response_store`` and ``msg_store``,
    kept only when ``store`` is on)."""

    def __init__(self, model: SimModel, max_model_len: int, block_size: int, store: bool) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.store = store
        self.responses: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}

    def turn(self, body: dict[str, Any]) -> ResponsesTurn:
        """``_create_responses`` up to the generation, in vLLM's order (a checked body)."""
        check_model(body, self.model.name, required=False)
        if body.get("background"):
            if not self.store:
                raise EngineError(
                    "This vLLM engine does not support `store=True` and therefore does not support the background "
                    f"mode. To enable these features, set the environment variable `{STORE_ENV}=1` when launching "
                    "the vLLM server.", "background", kind="invalid_request_error")
            raise EngineError("background responses are not simulated", "background", 501, "NotImplementedError")
        store = self.store and bool(body.get("store", True))
        history, previous_output = None, None
        if body.get("previous_response_id") is not None:
            previous = self.get(body["previous_response_id"])
            history, previous_output = self.messages.get(previous["id"]), previous["output"]
        messages = input_messages(body, history, previous_output)
        cont = continues_final_message(body["input"])
        conversation = Conversation(
            messages, tools=template_tools(body.get("tools") or []),
            chat_template_kwargs=body.get("chat_template_kwargs"),
            reasoning_effort=(body.get("reasoning") or {}).get("effort"),
            add_generation_prompt=not cont, continue_final_message=cont, add_special_tokens=True,
        )
        requested = body.get("max_output_tokens")
        check_output_request(requested, self.max_model_len, "max_output_tokens")
        ids = prompt_ids(self.model.tokenizer, conversation)
        check_prompt_len(len(ids), self.max_model_len)
        if len(ids) >= self.max_model_len:  # ``_validate_generator_input``: no room left for one output token
            raise EngineError(f"The engine prompt length {len(ids)} exceeds the max_model_len {self.max_model_len}. "
                              "Please reduce prompt.", "input", kind="invalid_request_error")
        max_tokens = output_budget(len(ids), requested, self.max_model_len)
        options = {"max_tokens": max_tokens, "stream": bool(body.get("stream")), "cache_salt": body.get("cache_salt"),
                   "kv_transfer_params": body.get("kv_transfer_params"), "vllm_xargs": body.get("vllm_xargs"),
                   "session_id": body.get("session_id")}
        return ResponsesTurn(body.get("request_id") or f"resp_{random_id()}", ids, options, messages, max_tokens,
                             resolved_tool_choice(body.get("tool_choice", "auto"), body.get("tools") or []), store)

    def answer(self, body: dict[str, Any], turn: ResponsesTurn) -> ResponsesAnswer:
        """The turn's answer; a stored turn's messages are kept now, its response once it is complete."""
        if turn.store:
            self.messages[turn.response_id] = turn.messages
        return ResponsesAnswer(body, turn, self.model, self.block_size, self._keep if turn.store else None)

    def get(self, response_id: str) -> dict[str, Any]:
        """``retrieve_responses`` (and ``previous_response_id``'s lookup): the stored response, or a 404."""
        response = self.responses.get(response_id)
        if response is None:
            raise EngineError(f"Response with id '{response_id}' not found.", "response_id", 404,
                              "invalid_request_error")
        return response

    def cancel(self, response_id: str) -> NoReturn:
        """``cancel_responses``: only a background response still queued or running can be cancelled; the sim runs
        no background response, so a stored one is a 400 (it was synchronous) and any other id a 404."""
        self.get(response_id)
        raise EngineError("Cannot cancel a synchronous response.", "response_id", kind="invalid_request_error")

    def restart(self) -> None:
        """A new engine process: the store lived in the old one."""
        self.responses.clear()
        self.messages.clear()

    def _keep(self, response: dict[str, Any]) -> None:
        self.responses[response["id"]] = response


# --- the answer --------------------------------------------------------------------------------------------------
class ResponsesAnswer:
    """A ``response`` object (dumped with its nulls), or its events, each ``event: <type>`` with a
    ``sequence_number`` from 0: ``response.created`` and ``response.in_progress`` as soon as the request is
    accepted, ``response.output_item.added`` and ``response.content_part.added`` with the first token, a
    ``response.output_text.delta`` per token, then ``output_text.done``, ``content_part.done``,
    ``output_item.done`` and ``response.completed``, the only event with the usage; no ``[DONE]``. The sim stops at
    the token budget, so every response ends ``incomplete`` (``max_output_tokens``), as vLLM's do at ``length``."""

    def __init__(self, body: dict[str, Any], turn: ResponsesTurn, model: SimModel, block_size: int,
                 keep: Callable[[dict[str, Any]], None] | None) -> None:
        self.request = body
        self.turn = turn
        self.model = model
        self.block_size = block_size
        self.keep = keep
        self.created_at = int(time.time())
        self.item_id = f"msg_{random_id()}"
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """``ResponsesResponse.from_request``: the request's settings echoed (sampling values as resolved)."""
        body = self.request
        include = body.get("include") or []
        return {
            "id": self.turn.response_id, "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": self.model.name,
            "object": "response", "output": output,
            "parallel_tool_calls": True if body.get("parallel_tool_calls") is None else body["parallel_tool_calls"],
            "temperature": float(_or(body.get("temperature"), 1.0)), "tool_choice": self.turn.tool_choice,
            "tools": [_echoed_tool(t) for t in body.get("tools") or []], "top_p": float(_or(body.get("top_p"), 1.0)),
            "background": bool(body.get("background")), "max_output_tokens": self.turn.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": body.get("previous_response_id"),
            "prompt": None, "reasoning": _echoed_reasoning(body.get("reasoning")),
            "service_tier": body.get("service_tier", "auto"), "status": status, "text": _echoed_text(body.get("text")),
            "top_logprobs": _or(body.get("top_logprobs"), 0) if LOGPROBS_INCLUDE in include else None,
            "truncation": body.get("truncation") or "disabled", "usage": usage, "user": body.get("user"),
            "presence_penalty": float(_or(body.get("presence_penalty"), 0.0)),
            "frequency_penalty": float(_or(body.get("frequency_penalty"), 0.0)),
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    def usage(self, req: SimRequest) -> dict[str, Any]:
        """``input_tokens`` counts the cached tokens too (``cached_tokens``, reported whatever the server's
        ``--enable-prompt-tokens-details``); the per-turn lists stay empty on the non-Harmony path."""
        return {
            "input_tokens": req.prompt_len,
            "input_tokens_details": {"cached_tokens": req.cached_tokens,
                                     "cache_write_tokens": cache_creation_tokens(req, self.block_size),
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": len(req.output),
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": req.prompt_len + len(req.output),
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [_output_text(text, None)] if text else []
        return {"id": self.item_id, "content": content, "role": "assistant", "status": status, "type": "message",
                "phase": None}

    def completed(self, req: SimRequest) -> dict[str, Any]:
        """The finished response, kept in the store when the turn is stored."""
        final = self.response("incomplete", [self.message(self.model.text(req.output), "completed")], self.usage(req))
        final["kv_transfer_params"] = req.kv_transfer_params_out
        if self.keep is not None:
            self.keep(final)
        return final

    def body(self, req: SimRequest) -> dict[str, Any]:
        return self.completed(req)

    def opening(self) -> bytes:
        initial = self.response("in_progress", [], None)
        return (self._event({"response": initial, "type": "response.created"})
                + self._event({"response": initial, "type": "response.in_progress"}))

    def first(self, req: SimRequest) -> bytes:
        return (self._event({"item": self.message("", "in_progress"), "output_index": 0,
                             "type": "response.output_item.added"})
                + self._event({"content_index": 0, "item_id": self.item_id, "output_index": 0,
                               "part": _output_text("", []), "type": "response.content_part.added"}))

    def token(self, req: SimRequest, token_id: int, last: bool) -> bytes:
        return self._event({"content_index": 0, "delta": self.model.token_text[token_id], "item_id": self.item_id,
                            "logprobs": [], "output_index": 0, "type": "response.output_text.delta"})

    def closing(self, req: SimRequest) -> bytes:
        text = self.model.text(req.output)
        final = self.completed(req)
        return (self._event({"content_index": 0, "item_id": self.item_id, "logprobs": [], "output_index": 0,
                             "text": text, "type": "response.output_text.done"})
                + self._event({"content_index": 0, "item_id": self.item_id, "output_index": 0,
                               "part": _output_text(text, None), "type": "response.content_part.done"})
                + self._event({"item": self.message(text, "completed"), "output_index": 0,
                               "type": "response.output_item.done"})
                + self._event({"response": final, "type": "response.completed"}))

    def _event(self, event: dict[str, Any]) -> bytes:
        """The event with its sequence number; openai's event models list their fields alphabetically."""
        numbered = dict(sorted({**event, "sequence_number": self.sequence}.items()))
        self.sequence += 1
        return named_sse(event["type"], numbered)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as openai's ``FunctionTool`` dumps it (every field, nulls included, then any other key the
    request gave); other tools as the request gave them."""
    if tool["type"] != "function":
        return tool
    return {**{k: tool.get(k) for k in FUNCTION_TOOL_FIELDS}, **tool}


def _echoed_reasoning(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if reasoning is None else {**{k: reasoning.get(k) for k in REASONING_FIELDS}, **reasoning}


def _echoed_text(text: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if text is None else {"format": text.get("format"), "verbosity": text.get("verbosity"), **text}
