"""A conversation as vLLM's renderer takes it from every chat-shaped API, and how it becomes the prompt's token ids.

vLLM turns a chat completions, Messages or Responses request into OpenAI-format messages, tools and template options
and renders them one way (``OnlineRenderer.preprocess_chat``): the request's own fields (``add_generation_prompt``,
``continue_final_message``, ``documents``, ``reasoning_effort`` and the ``enable_thinking`` it implies) are merged
over its ``chat_template_kwargs`` (``merge_kwargs``: a None or ``"auto"`` value never overrides), the tools are
handed to the template as their request model dumps them, the template is rendered
(:meth:`loadgen.sim.tokenizer.SimTokenizer.render_chat`) and the text encoded, with the BOS post-processor for
Responses only (``add_special_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import EngineError
from .tokenizer import ChatTemplateError, SimTokenizer

UNSET_VALUES = (None, "auto")
"""``merge_kwargs``: a request value that leaves the template's default alone."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """What one request asks the template to render: OpenAI-format ``messages``, the ``tools`` as the template sees
    them (:func:`tool_dicts`), the request's template options and how the rendered text is encoded."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[Any] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = False

    def template_kwargs(self) -> dict[str, Any]:
        """``build_chat_params``: the request's fields over its ``chat_template_kwargs``; ``enable_thinking``
        follows the effort (anything but ``"none"`` enables it) unless the request's kwargs set it."""
        user = self.chat_template_kwargs or {}
        fields: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            fields["enable_thinking"] = self.reasoning_effort != "none"
        return user | {k: v for k, v in fields.items() if v not in UNSET_VALUES}


def render_text(tokenizer: SimTokenizer, conversation: Conversation) -> str:
    """The prompt text; a conversation the template refuses is a 400."""
    if not conversation.messages:
        raise EngineError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    try:
        return tokenizer.render_chat(
            conversation.messages, chat_template=conversation.chat_template, tools=conversation.tools,
            chat_template_kwargs=conversation.template_kwargs(),
        )
    except ChatTemplateError as e:  # a template that rejects the conversation (raise_exception, bad roles, ...)
        raise EngineError(f"chat template error: {e}", "messages") from None


def prompt_ids(tokenizer: SimTokenizer, conversation: Conversation) -> list[int]:
    return tokenizer.encode(render_text(tokenizer, conversation), conversation.add_special_tokens)


def tool_dicts(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``[tool.model_dump() for tool in request.tools]``: each tool parsed into ``ChatCompletionToolsParam``
    (``type``, ``function``, ``defer_loading``) around ``FunctionDefinition`` (``name``, ``description``,
    ``parameters``, ``strict``, ``defer_loading``) and dumped in that field order; their serializers drop unknown
    fields and a ``strict`` / ``defer_loading`` that is None, and a tool's ``defer_loading`` is copied to its function
    when the function has none. A tool that does not parse is a 400, as in vLLM. Messages and Responses tools reach
    the template through the same models."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or tool.get("type", "function") != "function":
            raise EngineError(f"tools[{i}] must be a function tool with a function name", "tools")
        description, parameters = function.get("description"), function.get("parameters")
        if (description is not None and not isinstance(description, str)) \
                or (parameters is not None and not isinstance(parameters, dict)):
            raise EngineError(f"tools[{i}].function has a bad description or parameters", "tools")
        tool_defer = tool.get("defer_loading")
        function_defer = function.get("defer_loading")
        dumped = {"name": function["name"], "description": description, "parameters": parameters}
        for key, value in (("strict", function.get("strict")),
                           ("defer_loading", tool_defer if function_defer is None else function_defer)):
            if value is not None:
                dumped[key] = value
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool_defer is not None:
            entry["defer_loading"] = tool_defer
        out.append(entry)
    return out
