"""The parse stage: the body decoded once (msgspec), by its API; its model one a replica serves or the policy file
declares, and one the caller may use; no field that steers the engine; and its cache salt the tenant's own.

:class:`Parsed` is the one typed parse of a request body: every later stage, explain and the endpoint flows read it,
and what they need of the API's own fields they ask its :class:`~kvgate.router.apis.base.Api`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvgate.router.apis.base import Api
from kvgate.router.core.errors import ApiError
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.pipeline.bodies import (
    client_salt, form_field, parse_body, priority_of, refuse_engine_steering, required_model, wants_stream,
)
from kvgate.router.routing.catalog import ModelCatalog

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Parsed:
    """A decoded request. ``raw`` is what is forwarded: the bytes as received unless a field had to be set."""

    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    cache_salt: str | None
    api: Api | None
    """The API the body speaks; None for a body forwarded as it is (embeddings)."""
    max_tokens: int | None = None
    """The request's output budget, when its API says one."""
    session_id: str | None = None
    """A session key the body carries (:attr:`~kvgate.router.apis.base.Api.session_of`)."""
    priority: int | None = None
    """The body's ``priority`` (vLLM's: lower runs first), when it names one."""


def parse(
    raw: bytes, api: Api | None, catalog: ModelCatalog, may_use: Callable[[str], bool] = lambda model: True,
    max_id_chars: int = 256,
) -> Parsed:
    """Not a JSON object, without a model, naming a model no replica serves or the caller may not use (``may_use``),
    setting a field that steers the engine (:data:`~kvgate.router.pipeline.bodies.ENGINE_STEERING_FIELDS`), or a
    session key longer than ``max_id_chars`` is an :class:`ApiError`."""
    body = parse_body(raw)
    refuse_engine_steering(body)
    model = required_model(body)
    check_model(model, catalog, may_use)
    if api is None:
        return Parsed(raw, body, model, wants_stream(body), client_salt(body), None)
    session_id = api.session_of(body)
    if session_id is not None and len(session_id) > max_id_chars:
        raise ApiError(400, f"the session key has {len(session_id)} characters; the limit is {max_id_chars}",
                       param="prompt_cache_key", code="invalid_value")
    return Parsed(raw, body, model, wants_stream(body), client_salt(body), api, api.max_tokens(body), session_id,
                  priority_of(body.get("priority"), "priority"))



def parse_forwarded(
    raw: bytes, content_type: str | None, catalog: ModelCatalog, may_use: Callable[[str], bool], *,
    model_optional: bool = False,
) -> Parsed:
    """A body forwarded as it is, read only for its model: a JSON object's ``model``, or a multipart form's ``model``
    field (an upload). With ``model_optional`` (``/tokenize``, ``/detokenize``, whose engine takes its own model when
    none is named) and no model named, the fleet's one model; a fleet of several needs one named."""
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() == "multipart/form-data":
        body: dict[str, Any] = {}
        model = form_field(raw, content_type, "model")
    else:
        body = parse_body(raw)
        refuse_engine_steering(body)
        model = body.get("model")
    if model is None and model_optional:
        served = catalog.base_models()
        if len(served) != 1:
            raise ApiError(400, "'model' is required: the fleet serves several models", param="model",
                           code="missing_field")
        model = served.pop()
    model = required_model({"model": model})
    check_model(model, catalog, may_use)
    return Parsed(raw, body, model, False, None, None)


def check_model(model: str, catalog: ModelCatalog, may_use: Callable[[str], bool]) -> None:
    """A model the caller may not use gets the same 404 as one that does not exist: nothing says it does."""
    if catalog.knows(model) and may_use(model):
        return
    if not catalog.fleet.routable():
        raise ApiError(503, "no routable replica", code="no_replica")
    raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def salt_for_tenant(parsed: Parsed, tenants: TenantResolver, tenant: str | None) -> Parsed:
    """With tenants, the engine gets the tenant's own salt (derived from the client's, if any), so no two tenants'
    prompts share cache entries; the body is re-encoded only when the salt changed."""
    salt = tenants.cache_salt(tenant, parsed.cache_salt)
    if salt != parsed.cache_salt:
        parsed.body["cache_salt"] = salt
        parsed.raw = _encode(parsed.body)
        parsed.cache_salt = salt
    return parsed
