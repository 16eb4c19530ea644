"""kvgate's errors: error answers in each API's own shape, and the error of a policy file that cannot be used.

Client mistakes (bad JSON, missing fields, unknown model, too large, bad key) raise :class:`ApiError` anywhere on the
request path. The flow that knows the request's API answers it in that API's :class:`ErrorShape` (OpenAI's
``{"error": {"message", "type", "param", "code"}}`` by default, :data:`OPENAI_ERRORS`), so every client SDK shows
kvgate's errors the way it shows its provider's. The server's own errors (unknown route, wrong method, malformed
HTTP, admin body validation) get OpenAI's shape, so no client ever sees a bare HTML or plain-text error, and an
unexpected bug is a 500 in the same shape rather than a dropped connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from starlette.responses import Response

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ConfigError(Exception):
    """A policy file that cannot be used; the message names the field and the problem, never a value."""


class ApiError(Exception):
    """A request that kvgate answers with an OpenAI-style error instead of proxying it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers
        """Headers the answer carries (``Retry-After``, rate limits)."""

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def encoded(self) -> bytes:
        return msgspec.json.encode(self.body())

    def response(self, headers: dict[str, str] | None = None, shape: ErrorShape | None = None) -> Response:
        """The error as an answer, in ``shape`` (an API's; OpenAI's when None)."""
        body = self.encoded() if shape is None else shape.body(self)
        if self.headers:
            headers = {**self.headers, **(headers or {})}
        return Response(body, status_code=self.status, headers=headers, media_type="application/json")


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one API writes an error: as an answer's body, as the events that end a stream already under way, and what
    an engine's own error answer becomes (the engine may use another API's shape, or none)."""

    body: Callable[[ApiError], bytes]
    stream_events: Callable[[ApiError], bytes]
    from_engine: Callable[[int, bytes, str | None], tuple[bytes, str]]
    """(status, body, content type) of an engine's error answer → the body and content type the client gets."""


def _openai_stream_events(err: ApiError) -> bytes:
    """OpenAI's streaming error form: an error event, then the stream's end."""
    return b"data: " + err.encoded() + b"\n\ndata: [DONE]\n\n"


def unexpected_error(exc: BaseException) -> Response:
    """A bug on the request path: logged with its traceback, answered as an OpenAI-style 500."""
    log.exception("unhandled error on the request path", exc_info=exc)
    return ApiError(500, "internal error in kvgate", code="internal_error").response()


def json_response(content: object, status: int = 200) -> Response:
    """A JSON answer (msgspec's encoding: compact, and several times faster than the standard library's)."""
    return Response(_encode(content), status_code=status, media_type="application/json")


def as_json_error(status: int, body: bytes, content_type: str | None) -> tuple[bytes, str]:
    """An engine's error answer as the client gets it: as the engine sent it when it is JSON (vLLM's and SGLang's
    own error shapes are OpenAI's), else kvgate's OpenAI-style error naming the status (an engine's plain-text 500
    says nothing a client can use, and may say what it should not)."""
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json":
        return body, content_type
    err = ApiError(status, f"the upstream replica answered {status}", code="upstream_error")
    return err.encoded(), "application/json"


OPENAI_ERRORS = ErrorShape(body=ApiError.encoded, stream_events=_openai_stream_events, from_engine=as_json_error)
"""OpenAI's error shape: chat completions, completions, Responses, embeddings, and kvgate's own endpoints."""

