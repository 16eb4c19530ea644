"""Rendering chat templates that requests bring themselves, where they cannot stall or exhaust the gateway.

A chat template is a program: a 199-byte nested loop runs for seconds, ``{{ 'x' * 10000000 }}`` allocates a prompt of
ten million characters. The model's own template is the operator's, and renders in-process; a request's own template
(accepted only with ``limits.trust_request_chat_template``, vLLM's ``--trust-request-chat-template``) renders in a
child process: jinja2's ``ImmutableSandboxedEnvironment`` as for every template
(:mod:`kvgate.router.prompts.chat_template`), an address-space limit (``resource.RLIMIT_AS``), a wall-clock limit after
which the child is killed and replaced, and a limit on the rendered text's size. One child renders one template at a
time; the event loop only waits on a pipe.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import resource
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import jinja2

from kvgate.router.prompts.content_format import ContentFormatOption

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0
"""A fresh child imports jinja2 and the tokenization module before it takes work; that is not the template's time."""
COMPILED_TEMPLATES = 32
"""Compiled request templates the child keeps (the most recently used)."""


@dataclass(frozen=True, slots=True)
class TemplateJob:
    """What rendering a request's template needs, all of it picklable: the template, the model's special tokens,
    and the chat as :meth:`kvgate.router.prompts.model_templates.ModelTemplates.plan` made it."""

    source: str
    special_tokens: dict[str, str]
    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    content_format: ContentFormatOption
    max_chars: int
    scope: str
    """The request's cache scope (model and tenant namespace): compiled templates are not shared across scopes, so
    a template's compile time tells nobody what another tenant sent."""


class TemplateRejected(Exception):
    """The template cannot be used for this request; ``param`` names the field to blame (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestTemplateRenderer:
    """Renders :class:`TemplateJob` s in one child process, one at a time, each within ``timeout_s``."""

    def __init__(self, timeout_s: float, memory_mb: int) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.killed = 0
        """Renders that ran out of time (their child was killed)."""
        self._lock = asyncio.Lock()
        self._process: BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None

    async def render(self, job: TemplateJob) -> str:
        """The rendered prompt text. Raises :class:`TemplateRejected` for a template that does not parse, fails,
        renders more than ``job.max_chars`` characters, runs out of memory or out of time."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            conn = await loop.run_in_executor(None, self._started)
            conn.send(job)
            answer = await loop.run_in_executor(None, _receive, conn, self.timeout_s)
            if answer is None:
                self.killed += 1
                await loop.run_in_executor(None, self.close)
                raise TemplateRejected(
                    f"chat_template did not render within {self.timeout_s:g} s", "chat_template"
                )
        kind, payload = answer
        if kind == "ok":
            return payload
        raise TemplateRejected(payload, "messages" if kind == "render" else "chat_template")

    def close(self) -> None:
        """Stop the child (a new one starts with the next render)."""
        process, self._process = self._process, None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.join(timeout=5)

    def _started(self) -> multiprocessing.connection.Connection:
        """The child's pipe, starting a child first when there is none (runs on a worker thread: spawning blocks)."""
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self.close()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=serve, args=(child, self.memory_mb * 1024 * 1024), name="kvgate-request-templates", daemon=True
        )
        process.start()
        child.close()
        if _receive(parent, STARTUP_TIMEOUT_S) != ("ready", None):
            process.kill()
            process.join(timeout=5)
            raise TemplateRejected("the request template renderer did not start", "chat_template")
        self._process, self._conn = process, parent
        return parent


def _receive(conn: multiprocessing.connection.Connection, timeout_s: float) -> tuple[str, Any] | None:
    """The child's next message, or None when none came within ``timeout_s`` or the child died."""
    try:
        if conn.poll(timeout_s):
            return conn.recv()
    except (EOFError, OSError):
        pass
    return None


def serve(conn: multiprocessing.connection.Connection, memory_bytes: int) -> None:
    """The child's loop: render each job, answer ``("ok", text)`` or ``(kind, message)``; exit when the pipe closes."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from kvgate.router.prompts.chat_template import ChatTemplate, compile_chat_template, render_chat

    compiled: OrderedDict[tuple[str, str, tuple[tuple[str, Any], ...]], ChatTemplate] = OrderedDict()
    conn.send(("ready", None))
    while True:
        try:
            job: TemplateJob = conn.recv()
        except (EOFError, OSError):
            return
        try:
            key = (job.scope, job.source, tuple(sorted(job.special_tokens.items())))
            template = compiled.get(key)
            if template is None:
                template = compiled[key] = compile_chat_template(job.source, job.special_tokens)
                while len(compiled) > COMPILED_TEMPLATES:
                    compiled.popitem(last=False)
            text = render_chat(template, job.messages, job.kwargs, job.content_format)
            if len(text) > job.max_chars:
                answer = ("too_large", f"chat_template rendered {len(text)} characters; the limit is {job.max_chars}")
            else:
                answer = ("ok", text)
        except jinja2.TemplateSyntaxError as err:
            answer = ("syntax", f"chat_template does not parse: {err}")
        except MemoryError:
            answer = ("memory", "chat_template needed more memory than allowed")
        except RecursionError:
            answer = ("render", "cannot render the chat template: nested too deeply")
        except Exception as err:  # noqa: BLE001 - whatever the template raised is the request's problem
            answer = ("render", f"cannot render the chat template for these messages: {err}")
        try:
            conn.send(answer)
        except MemoryError:
            conn.send(("memory", "chat_template needed more memory than allowed"))
