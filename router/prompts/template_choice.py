"""Which chat template a request renders with: the templates a model directory holds, as transformers 5 loads them,
the operator's ``chat_template`` setting, as vLLM loads ``--chat-template``, and the choice between them per request,
as vLLM's ``resolve_chat_template`` and transformers' ``get_chat_template`` make it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TokenizerTemplates = str | dict[str, str] | None
"""A tokenizer's chat template: one text, or texts by name (``default``, ``tool_use``, ...), or none."""

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
"""Transformers 5's template files next to tokenizer_config.json (``CHAT_TEMPLATE_FILE``, ``CHAT_TEMPLATE_DIR``)."""

PATH_UNLIKE_CHARS = "{}\n"
"""A ``--chat-template`` value with any of these that is not a readable file is the template itself (vLLM's rule)."""


def tokenizer_templates(directory: Path, config: dict[str, Any]) -> TokenizerTemplates:
    """The chat template(s) transformers loads for a local tokenizer directory (``_from_pretrained``,
    tokenization_utils_base.py L1663-1669 and L1784-1801, and ``__init__`` L1078-1082): ``chat_template.jinja`` (as
    ``default``) and ``additional_chat_templates/<name>.jinja``, which replace tokenizer_config.json's own when
    present (one ``default`` alone is a plain text); else tokenizer_config.json's ``chat_template``, a list of
    ``{name, template}`` becoming texts by name."""
    files: dict[str, str] = {}
    default_file = directory / TEMPLATE_FILE
    if default_file.is_file():
        files["default"] = default_file.read_text(encoding="utf-8")
    named_dir = directory / TEMPLATES_DIR
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    value = config.get("chat_template")
    if isinstance(value, list):
        return {entry["name"]: entry["template"] for entry in value}
    return value


def load_chat_template(value: str) -> str:
    """The template text of a ``chat_template`` setting, as vLLM loads ``--chat-template`` (``load_chat_template``,
    renderers/chat_utils.py L1492-1548): the file's contents when it opens, else the value itself when it looks like
    a template (holds ``{``, ``}`` or a newline).

    Raises ``ValueError`` for a value that looks like a path but cannot be read. vLLM then tries it as the name of
    one of its built-in templates (``template_chatml.jinja``...), which kvgate does not carry: give their path.
    """
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except ValueError as err:  # a NUL in the value, or a file that is not UTF-8: vLLM does not start either
        raise ValueError(f"chat_template: {err}") from err
    except OSError as err:
        if any(char in value for char in PATH_UNLIKE_CHARS):
            return value
        raise ValueError(
            f"chat_template: cannot read {value!r} ({err.strerror or err}); a value without '{{', '}}' or a newline "
            "is a path to the template file (vLLM's built-in template names are not known to kvgate: give the file)"
        ) from err


def select_template(templates: TokenizerTemplates, given: str | None, tools: list[Any] | None) -> str:
    """Transformers' ``get_chat_template`` (tokenization_utils_base.py L3226-3278): ``given`` (a template, or the
    name of one of the tokenizer's), else the tokenizer's: its ``tool_use`` one when there are tools (even none:
    ``[]`` is tools), else its ``default``.

    Raises ``ValueError`` when neither names a template."""
    if isinstance(templates, dict):
        if given is not None:
            return templates.get(given, given)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"this model has several chat templates ({', '.join(sorted(templates))}) and no default")
    if given is not None:
        return given
    if templates is None:
        raise ValueError("this model has no chat template")
    return templates


def resolve_template(templates: TokenizerTemplates, given: str | None, tools: list[Any] | None) -> str | None:
    """vLLM's ``resolve_chat_template`` (renderers/hf.py L265-320) for a text-only model: ``given`` (the operator's
    or the request's template, or a name) through :func:`select_template`, else the tokenizer's own; None when there
    is none (vLLM's fallbacks by model type are for models kvgate does not render)."""
    try:
        return select_template(templates, given, tools)
    except ValueError:
        return None
