"""Which shape a chat template expects ``message.content`` in, found the way vLLM finds it: by walking the template's
syntax tree for a loop over a message's content (vLLM's ``_detect_content_format`` and ``_iter_nodes_assign_*`` in
``vllm/renderers/hf.py`` L343-508). What the answer changes in the conversation is
:func:`kvgate.router.prompts.conversation.conversation_for_template`'s business.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Literal

import jinja2.nodes

ContentFormat = Literal["string", "openai"]
"""How a template expects ``message.content``: one string (text parts joined), or the list of OpenAI parts."""
ContentFormatOption = Literal["auto", "string", "openai"]
"""An operator's choice (vLLM's ``--chat-template-content-format``): ``auto`` detects it from the template."""


class _NotAName(Exception):
    """A loop or ``set`` target that is not a plain name: vLLM asserts it is one, and its detection then falls back
    to ``string``."""


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """``openai`` when the template loops over a message's content, else ``string``; ``string`` too when the walk
    meets a shape it cannot follow, as vLLM's does (``_detect_content_format``, hf.py L490-508)."""
    try:
        found = next(_content_loops(ast), None)
    except _NotAName:
        return "string"
    return "string" if found is None else "openai"


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """``name.key`` or ``name['key']``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``) itself, filtered, tested or sliced (``messages[1:]``, ``messages | reverse``)."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _target_name(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _NotAName
    return node.name


def _names_assigned_from(root: jinja2.nodes.Template, name: str) -> set[str]:
    """``name`` and every variable ``set`` from it, directly or through others (``{% set loop_messages =
    messages[1:] %}``). vLLM walks the same assignments breadth first; a name already seen is not walked again, which
    gives the same names and ends where vLLM's walk loops forever on two names set from each other."""
    names = {name}
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                target = _target_name(assign.target)
                if target not in names:
                    names.add(target)
                    pending.append(target)
    return names


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    """The loop variables of loops over the messages (``{% for message in messages %}``)."""
    messages = _names_assigned_from(root, "messages")
    return [
        _target_name(loop.target)
        for loop in root.find_all(jinja2.nodes.For)
        if any(_is_var_or_elems(loop.iter, name) for name in messages)
    ]


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    """Loops over a message's content: ``{% for part in message.content %}``, a loop inside a macro over the
    parameter a call passes ``message.content`` to, and, outside macros, a loop over a variable named ``content``."""
    message_names = _message_names(root)

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems(node, name, "content") for name in message_names)

    content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and is_content(arg):
                    content_params.add(macro.args[i].name)
            for keyword in call.kwargs:
                if keyword.key in params and is_content(keyword.value):
                    content_params.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                content_params_by_loop[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if is_content(loop.iter):
            _target_name(loop.target)
            yield loop
        elif isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params_by_loop.get(id(loop), set()):
                _target_name(loop.target)
                yield loop
            elif id(loop) not in loops_in_macros and loop.iter.name == "content":
                _target_name(loop.target)
                yield loop
