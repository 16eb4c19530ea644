"""What a policy file means, checked before it is put in force: what its schema's types cannot say."""

from __future__ import annotations

import jinja2

from kvgate.policies.registry import POLICY_NAMES
from kvgate.router.core.auth import Credentials, peer_token
from kvgate.router.core.errors import ConfigError
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.prompts.chat_template import compile_chat_template
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.template_choice import load_chat_template
from kvgate.router.settings.schema import KvgateConfig


def check_meaning(config: KvgateConfig, previous: KvgateConfig | None = None) -> None:
    """What the schema's types cannot say: raises :class:`ConfigError` naming the field. Tokenizers are loaded to
    prove they load (only those whose model entry changed since ``previous``)."""
    if config.policy.name not in POLICY_NAMES:
        raise ConfigError(f"policy.name: unknown policy {config.policy.name!r}; "
                          f"expected one of {', '.join(POLICY_NAMES)}")
    if not config.replicas and config.discovery.kind == "none":
        raise ConfigError("replicas: at least one replica is required (or discovery.kind: dns or kubernetes)")
    unchanged = set(previous.models) if previous is not None else set()
    for i, model in enumerate(config.models):
        if model in unchanged:
            continue
        if model.chat_template is not None:
            try:
                source = load_chat_template(model.chat_template)
            except ValueError as err:
                raise ConfigError(f"models.{i}.{err}") from err  # the message starts with "chat_template:"
            try:
                compile_chat_template(source, {})
            except jinja2.TemplateSyntaxError as err:
                raise ConfigError(f"models.{i}.chat_template: does not parse: {err}") from err
        if model.tokenizer is None:
            continue
        try:
            ModelTokenizer.from_path(model.tokenizer)
        except Exception as err:  # tokenizers, json and jinja2 each raise their own types
            raise ConfigError(f"models.{i}.tokenizer: cannot load {model.tokenizer!r}: {err}") from err
    TenantResolver(config.tenants)  # a bad keys file or a missing salt secret rejects the whole config
    Credentials.of(config.server)
    hints = config.peers.hints
    if (hints.bind or hints.connect or hints.port is not None) and peer_token(config.server) is None:
        raise ConfigError("peers.hints: needs server.peer_token (or the admin token), which keys the hints' encryption")
