"""A model's chat templates as its vLLM server applies them: which template a chat renders with, with which
messages, variables and content format (:meth:`ModelTemplates.plan`), and the two things vLLM's Messages front door
probes the server's templates for once (:attr:`ModelTemplates.merges_inline_system`,
:attr:`ModelTemplates.disabled_thinking_effort`).

Rendering itself is :func:`kvgate.router.prompts.chat_template.render_chat`: here for the model's own templates,
in the sandboxed child process (:mod:`kvgate.router.prompts.request_templates`) for a request's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jinja2

from kvgate.router.core.config import ModelConfig
from kvgate.router.prompts.chat_template import ChatTemplate, compile_chat_template, merges_inline_system, render_chat
from kvgate.router.prompts.content_format import ContentFormat, ContentFormatOption
from kvgate.router.prompts.prompt import ChatPrompt
from kvgate.router.prompts.template_choice import TokenizerTemplates, load_chat_template, resolve_template
from kvgate.router.prompts.template_kwargs import server_defaults, template_kwargs

THINKING_EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""The Messages API's efforts (vLLM's ``AnthropicEffort``), in the order vLLM's probe renders them."""
THINKING_PROBE = [{"role": "user", "content": "Hi"}]
"""The chat vLLM renders at each effort to find the template's disabled-thinking effort."""


@dataclass(frozen=True, slots=True)
class TemplateSettings:
    """An operator's rendering settings for one model: vLLM's ``--chat-template`` (as its text),
    ``--chat-template-content-format`` and ``--default-chat-template-kwargs``."""

    chat_template: str | None = None
    content_format: ContentFormatOption = "auto"
    default_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: ModelConfig) -> "TemplateSettings":
        """A model entry's settings, its ``chat_template`` read now (``ValueError`` when it cannot be)."""
        template = load_chat_template(model.chat_template) if model.chat_template is not None else None
        return cls(template, model.chat_template_content_format, dict(model.default_chat_template_kwargs))


@dataclass(frozen=True, slots=True)
class ChatRender:
    """What one chat renders as (:meth:`ModelTemplates.plan`): hand it to
    :func:`~kvgate.router.prompts.chat_template.render_chat` with :attr:`template`, or compile :attr:`source`
    first when that is a request's own template."""

    source: str
    template: ChatTemplate | None
    """The compiled template when it is the model's own (the operator's or the tokenizer's); None for a request's
    own, which only the sandboxed renderer compiles."""
    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    content_format: ContentFormatOption
    """``auto`` only when the request's ``chat_template`` field chose the template: its format is then the one
    detected in that template's own text."""


class ModelTemplates:
    """One model's chat templates: the tokenizer's, the operator's, and the choice between them and a request's."""

    def __init__(self, templates: TokenizerTemplates, settings: TemplateSettings, special_tokens: dict[str, str]):
        """Compiles the model's own templates (one that does not parse fails the requests that use it, as in vLLM)
        and runs the two probes. An error other than a template error in the inline-system probe propagates: vLLM
        does not start with such a template."""
        self._templates = templates
        self.settings = settings
        self.special_tokens = special_tokens
        self._defaults = server_defaults(settings.default_kwargs)
        own = [settings.chat_template] + (list(templates.values()) if isinstance(templates, dict) else [templates])
        self._compiled: dict[str, ChatTemplate | jinja2.TemplateSyntaxError] = {
            source: self._compile(source) for source in own if source is not None
        }
        self.merges_inline_system = any(
            merges_inline_system(resolve_template(templates, settings.chat_template, tools)) for tools in (None, [])
        )
        """Whether a Messages body's inline system messages are merged into its leading one for this model
        (``AnthropicServingMessages._should_merge_inline_system``, serving.py L239-270): the template probe of
        :func:`~kvgate.router.prompts.chat_template.merges_inline_system` on the template chosen without tools
        and on the one chosen with tools (a dict template's ``tool_use``), merging when either needs it."""
        self.disabled_thinking_effort = self._probe_disabled_thinking_effort()
        """The reasoning effort of a Messages body with thinking disabled (``--anthropic-disabled-thinking-effort
        auto``, ``_probe_disabled_thinking_effort``, serving.py L207-219): ``low`` when rendering a chat with effort
        ``none`` fails or renders as one of the thinking efforts does, else ``none``."""

    @property
    def has_own(self) -> bool:
        """Whether the model has a template of its own (without one, only a request's template renders)."""
        return bool(self._compiled)

    def _compile(self, source: str) -> ChatTemplate | jinja2.TemplateSyntaxError:
        try:
            return compile_chat_template(source, self.special_tokens)
        except jinja2.TemplateSyntaxError as err:
            return err

    def compiled(self, source: str) -> ChatTemplate:
        """``source`` compiled: the model's own from the cache, any other now (only for trusted callers: a request's
        template renders in the sandboxed child). Raises ``jinja2.TemplateSyntaxError``."""
        template = self._compiled.get(source)
        if template is None:
            template = self._compile(source)
        if isinstance(template, jinja2.TemplateSyntaxError):
            raise template
        return template

    def plan(self, prompt: ChatPrompt) -> ChatRender:
        """What ``prompt`` renders as on this model's vLLM server (vLLM's ``build_chat_params``, ``preprocess_chat``,
        ``resolve_chat_template_content_format`` and ``safe_apply_chat_template``'s template choice):

        - the template: the request's own (its ``chat_template``), else the operator's, else the tokenizer's for
          these tools; a template given only in ``chat_template_kwargs`` counts only when the operator sets none,
          and then does not decide the content format;
        - the messages: :attr:`~ChatPrompt.system_merged` when this model merges inline system messages;
        - the reasoning effort: the disabled-thinking effort when thinking is disabled;
        - the kwargs, in vLLM's precedence (:func:`~kvgate.router.prompts.template_kwargs.template_kwargs`).

        Raises ``ValueError`` when no template applies."""
        body_template = prompt.chat_template if not _template_in_kwargs(prompt) else None
        params_template = body_template or self.settings.chat_template
        effort = self.disabled_thinking_effort if prompt.thinking_disabled else prompt.reasoning_effort
        kwargs = template_kwargs(
            prompt.chat_template_kwargs, add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message, documents=prompt.documents,
            reasoning_effort=effort, tools=prompt.tools, defaults=self._defaults, chat_template=params_template,
        )
        tools = kwargs.get("tools")
        source = resolve_template(self._templates, kwargs.pop("chat_template", None), tools)
        if source is None:
            raise ValueError("this model has no chat template")
        messages = prompt.messages
        if prompt.system_merged is not None and self.merges_inline_system:
            messages = prompt.system_merged
        content_format = self.settings.content_format
        if content_format == "auto" and not body_template:
            content_format = self._detected_format(resolve_template(self._templates, params_template, tools))
        template = self._compiled.get(source)
        if isinstance(template, jinja2.TemplateSyntaxError):
            raise template
        return ChatRender(source, template, messages, kwargs, content_format)

    def _detected_format(self, source: str | None) -> ContentFormat:
        """The content format vLLM detects for a template of the model's; ``string`` for none or one that does not
        parse."""
        template = self._compiled.get(source) if source is not None else None
        return template.detected_format if isinstance(template, ChatTemplate) else "string"

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text of ``prompt``, rendered here whatever its template (trusted callers only)."""
        planned = self.plan(prompt)
        template = planned.template if planned.template is not None else self.compiled(planned.source)
        return render_chat(template, planned.messages, planned.kwargs, planned.content_format)

    def _probe_disabled_thinking_effort(self) -> str:
        none = self._probe_render("none")
        if none is None or any(self._probe_render(effort) == none for effort in THINKING_EFFORTS):
            return "low"
        return "none"

    def _probe_render(self, effort: str) -> str | None:
        """The probe chat rendered with ``effort``, or None when that fails (vLLM's ``_render_probe_prompt``)."""
        prompt = ChatPrompt(
            messages=THINKING_PROBE, add_generation_prompt=True, continue_final_message=False,
            add_special_tokens=False, chat_template=None, chat_template_kwargs=None, tools=None, documents=None,
            has_media=False, reasoning_effort=effort,
        )
        try:
            return self.render(prompt)
        except Exception:  # noqa: BLE001 - vLLM's probe takes any failure to render as "this effort fails"
            return None


def _template_in_kwargs(prompt: ChatPrompt) -> bool:
    """Whether the request's template came in ``chat_template_kwargs`` rather than its own ``chat_template`` field.
    The prompt carries one template either way; the kwargs holding that very text is taken to mean it came from
    there (the same text in both places is then read as the kwargs', which differs only with an operator template)."""
    kwargs_template = (prompt.chat_template_kwargs or {}).get("chat_template")
    return prompt.chat_template is not None and prompt.chat_template == kwargs_template
