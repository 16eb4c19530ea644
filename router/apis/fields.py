"""Reading a request body's fields the way the engine's request models validate them: a wrong type is a
:class:`PromptError` naming the field (the gateway answers 400), an absent or null field is the default."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from kvgate.router.prompts.prompt import PromptError

KIND_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer"}


def optional(body: dict[str, Any], name: str, kind: type, param: str | None = None) -> Any:
    """``body[name]`` when it is a ``kind`` (a bool is no integer), None when absent or null."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise PromptError(f"'{name}' must be {KIND_NAMES.get(kind, kind.__name__)}", param or name)
    return value


def one_of(value: Any, choices: Container[str]) -> bool:
    """Whether ``value`` is one of the string ``choices``: a client's list or object where a name belongs is none
    of them (and never reaches a set's hash)."""
    return isinstance(value, str) and value in choices


def optional_bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = optional(body, name, bool, param)
    return default if value is None else value


def chat_template_of(body: dict[str, Any], kwargs: dict[str, Any] | None) -> str | None:
    """A request's own chat template: its ``chat_template`` field, else ``chat_template_kwargs.chat_template``
    (vLLM takes one from either place)."""
    chat_template = optional(body, "chat_template", str)
    if chat_template is None and kwargs is not None and kwargs.get("chat_template") is not None:
        chat_template = kwargs["chat_template"]
        if not isinstance(chat_template, str):
            raise PromptError("'chat_template_kwargs.chat_template' must be a string", "chat_template_kwargs")
    return chat_template
