"""A prompt as the engine will render it, whatever API it came in: a completions prompt (text or token ids) or a chat
(OpenAI-format messages and the chat template's options), and the limits on its shape.

Each front door's body knowledge (:mod:`kvgate.router.apis`) makes one of these; the tokenizer
(:mod:`kvgate.router.prompts.tokenizer`) takes nothing else.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from kvgate.router.core.config import LimitsConfig
from kvgate.router.prompts.conversation import TEXT_PART_FIELDS


class PromptError(Exception):
    """A request body the engine would reject, or beyond ``limits``: the gateway answers 400 with this message,
    ``param`` and ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """A completions request's prompt: its text or token ids (the first of a batch; ``prompt_count`` prompts in all)."""

    text: str | None
    ids: array[int] | None
    add_special_tokens: bool
    prompt_count: int


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat: OpenAI-format messages and what the chat template is rendered with; ``has_media``: parts only the
    engine can turn into tokens."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    tools: list[Any] | None
    documents: list[Any] | None
    has_media: bool
    reasoning_effort: str | None = None
    """The request's reasoning effort (chat ``reasoning_effort``, Messages ``output_config.effort``, Responses
    ``reasoning.effort``): the template gets it as ``reasoning_effort``, and ``enable_thinking`` (whether it is not
    ``"none"``) unless the request's ``chat_template_kwargs`` set that (vLLM's rule)."""
    thinking_disabled: bool = False
    """Messages ``thinking: {type: disabled}``: the effort is the template's disabled-thinking effort instead (vLLM
    probes the template for it), overriding ``reasoning_effort``."""
    system_merged: list[dict[str, Any]] | None = None
    """The messages for a template that takes no system message after the first: vLLM merges a Messages body's inline
    system messages into its leading one for those. None: the messages are the same either way."""
    shared_prefix_end: str | None = None
    """Text the rendered prompt's shared prefix ends before: a client that marks its tools or system for caching
    (Anthropic's ``cache_control``) says every session sends that part again, and it is everything the template
    renders ahead of the conversation's first text, this. The tokenizer finds its length in tokens
    (:attr:`~kvgate.router.prompts.tokenizer.TokenizedPrompt.shared_tokens`)."""


Prompt = CompletionPrompt | ChatPrompt


def check_limits(prompt: CompletionPrompt | ChatPrompt, limits: LimitsConfig) -> None:
    """The request's shape against ``limits``: message count, prompt characters, and a request's own chat template
    only when the operator trusts them (vLLM's rule and message). Raises :class:`PromptError`."""
    if isinstance(prompt, ChatPrompt):
        if len(prompt.messages) > limits.max_messages:
            raise PromptError(
                f"the request has {len(prompt.messages)} messages; the limit is {limits.max_messages}", "messages",
                "too_many_messages",
            )
        if prompt.chat_template is not None and not limits.trust_request_chat_template:
            raise PromptError(
                "Chat template is passed with request, but --trust-request-chat-template is not set "
                "(limits.trust_request_chat_template). Refused request with untrusted chat template.",
                "chat_template", "untrusted_chat_template",
            )
    chars = text_chars(prompt)
    if chars > limits.max_prompt_chars:
        raise PromptError(
            f"the prompt has {chars} characters; the limit is {limits.max_prompt_chars}",
            "prompt" if isinstance(prompt, CompletionPrompt) else "messages", "prompt_too_long",
        )


def is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFFFFFF


def text_chars(prompt: CompletionPrompt | ChatPrompt) -> int:
    """Characters of prompt text (message contents for a chat): what tokenizing costs in proportion to."""
    if isinstance(prompt, CompletionPrompt):
        return len(prompt.text or "")
    total = 0
    for message in prompt.messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(plain_text(content))
    return total


def plain_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            text = part.get(TEXT_PART_FIELDS.get(str(part.get("type")), ""))
            if isinstance(text, str):
                texts.append(text)
    return "\n".join(texts)
