"""The admit stage: who is asking (request id, session, tenant from the API key), and the body, read within the
server's limits before anything else is done with it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.router.core.config import LimitsConfig, ServerConfig
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest
from kvgate.router.core.tenants import AuthError, TenantResolver
from kvgate.router.core.trace_context import TRACEPARENT, TRACESTATE, TraceParent, client_trace_context
from kvgate.router.pipeline.bodies import JsonBounds, read_body

if TYPE_CHECKING:
    from kvgate.router.pipeline.spans import RequestTrace


_RANDOM_BATCH = 4096
_random = bytearray()


def new_request_id() -> str:
    """An id for a request that came without ``X-Request-Id``: 128 random bits, 32 hex characters like a UUID's.
    Random, not a counter: a tenant watching its own ids advance would count everyone's requests. The bits come from
    the OS's CSPRNG (so no id helps predict another), read :data:`_RANDOM_BATCH` bytes at a time: one system call
    per 256 requests."""
    if not _random:
        _random.extend(os.urandom(_RANDOM_BATCH))
    bits = _random[-16:]
    del _random[-16:]
    return bits.hex()


SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id", b"session_id", b"session-id", b"x-session-affinity")
"""Headers that name the client's session, most specific first: kvgate's and vLLM's own, then what agentic clients
send (Claude Code's, Codex's and other routers' conventions)."""
PRIORITY_HEADER = b"x-vllm-priority"
_TRACEPARENT, _TRACESTATE = TRACEPARENT.encode(), TRACESTATE.encode()
_TRACE_HEADERS = frozenset((_TRACEPARENT, _TRACESTATE))
_CLIENT_HEADERS = frozenset((b"x-request-id", b"authorization", b"x-api-key", PRIORITY_HEADER, *SESSION_HEADERS,
                             *_TRACE_HEADERS))


@dataclass(slots=True)
class ClientHeaders:
    """The client headers the gateway acts on, read in one pass over the request's headers (first value of each).

    Anthropic's SDKs send their key as ``x-api-key``: without an ``Authorization`` header it stands for
    ``Authorization: Bearer <key>``, so tenants and engines see one form. The W3C trace headers are the exception to
    "first value": a repeated one is joined with a comma, as a list header is, which makes a repeated
    ``traceparent`` invalid and a repeated ``tracestate`` one list (:mod:`kvgate.router.core.trace_context`)."""

    request_id: str | None = None
    session_id: str | None = None
    authorization: str | None = None
    session_header: str = "x-session-id"
    """The header the session id came in."""
    priority: str | None = None
    """``X-Vllm-Priority``, as sent (:func:`kvgate.router.pipeline.bodies.priority_of` reads it)."""
    traceparent: TraceParent | None = None
    """The client's W3C ``traceparent``, when it is exactly valid."""
    tracestate: str | None = None
    """The client's ``tracestate``, when it and the ``traceparent`` are valid."""

    @classmethod
    def of(cls, headers: list[tuple[bytes, bytes]]) -> ClientHeaders:
        found: dict[bytes, str] = {}
        for name, value in headers:
            if name in _CLIENT_HEADERS:
                if name not in found:
                    found[name] = value.decode("latin-1")
                elif name in _TRACE_HEADERS:
                    found[name] += "," + value.decode("latin-1")
        header = next((h for h in SESSION_HEADERS if h in found), SESSION_HEADERS[0])
        authorization = found.get(b"authorization")
        if authorization is None and b"x-api-key" in found:
            authorization = f"Bearer {found[b'x-api-key']}"
        client = cls(found.get(b"x-request-id"), found.get(header), authorization, header.decode(),
                     found.get(PRIORITY_HEADER))
        if _TRACEPARENT in found:
            client.traceparent, client.tracestate = client_trace_context(found[_TRACEPARENT], found.get(_TRACESTATE))
        return client


@dataclass(slots=True)
class Admission:
    """A request as it arrived: when, its headers and id, and (once admitted) its tenant."""

    client: ClientHeaders
    request_id: str
    started: float = field(default_factory=time.monotonic)
    tenant: str | None = None
    trace: RequestTrace | None = None
    """The request's spans, when the gateway traces (:mod:`kvgate.router.pipeline.spans`); each stage tells it when
    it begins."""

    @classmethod
    def of(cls, request: HttpRequest) -> Admission:
        client = ClientHeaders.of(request.headers)
        return cls(client, client.request_id or new_request_id())


def resolve_tenant(tenants: TenantResolver, authorization: str | None) -> str | None:
    """The caller's tenant (None without tenants); a missing or unknown API key is a 401."""
    try:
        return tenants.resolve(authorization)
    except AuthError as e:
        raise ApiError(401, e.message, code=e.code) from e


def check_client_ids(client: ClientHeaders, limits: LimitsConfig) -> None:
    """A client's request or session id longer than ``limits.max_id_chars`` is a 400: both are forwarded, and a
    session id is remembered."""
    for name, value in (("x-request-id", client.request_id), (client.session_header, client.session_id)):
        if value is not None and len(value) > limits.max_id_chars:
            raise ApiError(400, f"the {name} header has {len(value)} characters; the limit is {limits.max_id_chars}",
                           param=name, code="invalid_header")


async def read_within_limits(
    request: HttpRequest, server: ServerConfig, limits: LimitsConfig, *, json: bool = True
) -> bytes:
    """The body as received: over ``server.max_body_bytes`` or (``json``) too many JSON values or objects is a 413,
    not in full within ``server.body_timeout_s`` a 408."""
    bounds = JsonBounds(limits.max_json_items, limits.max_json_objects) if json else None
    return await read_body(request, server.max_body_bytes, server.body_timeout_s, bounds)


def upstream_headers(
    client: ClientHeaders, request_id: str, tenants_enabled: bool, traced: bool = False
) -> dict[str, str]:
    """The headers sent to the engine: the request id, the session, the client's key when it is the engine's own
    (with tenants on, the key is kvgate's and stays here), and the client's valid trace context as it came when
    kvgate does not trace (``traced``: each attempt sends its own span's instead,
    :meth:`kvgate.router.upstream.proxy.Proxy.attempt`), so the engine continues the client's trace either way."""
    out = {"content-type": "application/json", "x-request-id": request_id}
    session_id = client.session_id
    if session_id:
        out["x-session-id"] = session_id
    authorization = client.authorization
    if authorization and not tenants_enabled:
        out["authorization"] = authorization
    traceparent = client.traceparent
    if traceparent is not None and not traced:
        out[TRACEPARENT] = traceparent.header
        if client.tracestate is not None:
            out[TRACESTATE] = client.tracestate
    return out
