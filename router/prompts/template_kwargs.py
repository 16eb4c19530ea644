"""The variables a chat template is rendered with, merged and filtered the way vLLM 0.32 does it.

Merged (``renderers/params.py`` ``merge_kwargs`` L36-48; ``ChatCompletionRequest.build_chat_params``,
``entrypoints/openai/chat_completion/protocol.py`` L621-655; ``OnlineRenderer.preprocess_chat``,
``renderers/online_renderer.py`` L773-791; ``ChatParams.with_defaults`` / ``get_apply_chat_template_kwargs``,
params.py L104-141): the request's own fields over its ``chat_template_kwargs``, over the tools, over the operator's
default kwargs, a ``None`` or ``"auto"`` never replacing anything. Filtered (``resolve_chat_template_kwargs``,
``renderers/hf.py`` L715-743): only what ``apply_chat_template`` names or the template reads reaches it.
"""

from __future__ import annotations

from typing import Any

UNSET_VALUES: tuple[Any, ...] = (None, "auto")
"""Values that leave a kwarg as the lower-precedence source set it (vLLM's ``unset_values``)."""

SERVER_DEFAULT_KWARGS: dict[str, Any] = {"cohere_format": "cmd4"}
"""What every vLLM server adds to its ``--default-chat-template-kwargs`` unless they set it (``--cohere-format``'s
default, ``resolve_default_chat_template_kwargs``, entrypoints/launchers/cli_args.py L411-418); a template that does
not read it never sees it."""

APPLY_CHAT_TEMPLATE_PARAMS = frozenset(
    {"self", "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
     "tokenizer_kwargs"}
)
"""The named parameters of transformers' ``apply_chat_template`` (``self`` included, as vLLM reads the signature):
vLLM passes a kwarg of these names whatever the template reads."""

RESOLVED_KWARGS = frozenset({"chat_template", "tokenize"})
"""Kwargs vLLM consumes before the template's are filtered: never template variables."""


def merge_kwargs(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``defaults`` updated with the ``overrides`` that are set (vLLM's ``merge_kwargs``)."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if v not in UNSET_VALUES}}


def server_defaults(operator_defaults: dict[str, Any]) -> dict[str, Any]:
    """A model's default kwargs as its vLLM server holds them: the operator's, plus :data:`SERVER_DEFAULT_KWARGS`."""
    return {**SERVER_DEFAULT_KWARGS, **operator_defaults}


def template_kwargs(
    request_kwargs: dict[str, Any] | None,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    documents: list[Any] | None,
    reasoning_effort: str | None,
    tools: list[Any] | None,
    defaults: dict[str, Any],
    chat_template: str | None,
) -> dict[str, Any]:
    """Everything vLLM hands ``safe_apply_chat_template`` for one request: ``chat_template`` (the template text or
    name to resolve, absent for the model's own), ``tools``, ``tokenize``, ``return_dict``, the request's fields and
    the kwargs from the request and the operator (``defaults``, from :func:`server_defaults`), in vLLM's precedence.

    A reasoning effort also sets ``enable_thinking`` (whether it is not ``"none"``) unless the request's kwargs name
    it, so templates that need thinking switched on get it."""
    fields: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": reasoning_effort,
    }
    if reasoning_effort is not None and "enable_thinking" not in (request_kwargs or {}):
        fields["enable_thinking"] = reasoning_effort != "none"
    request = merge_kwargs(request_kwargs, fields)
    kwargs = merge_kwargs(merge_kwargs(defaults, {"tools": tools, "tokenize": False}), request)
    return merge_kwargs(kwargs, {"chat_template": chat_template, "return_dict": False})


def accepted_kwargs(kwargs: dict[str, Any], variables: frozenset[str]) -> dict[str, Any]:
    """The kwargs vLLM lets through to ``apply_chat_template``: its named parameters, the template's undeclared
    variables (``variables``), never :data:`RESOLVED_KWARGS`. Anything else, a ``reasoning_effort`` for a template
    that never mentions it say, is dropped."""
    return {
        k: v for k, v in kwargs.items()
        if (k in APPLY_CHAT_TEMPLATE_PARAMS or k in variables) and k not in RESOLVED_KWARGS
    }
