"""Reading and validating OpenAI request bodies: once, cheaply, with OpenAI-style errors for client mistakes.

The gateway parses a body exactly once (msgspec) and checks only what routing needs; every other field passes through
to the engine unchanged, so the engine stays the judge of its own API.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from router.errors import ApiError

_decode = msgspec.json.Decoder().decode


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes by Content-Length or by what actually arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def required_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is required", param="model", code="missing_field")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", param="model", code="invalid_type")
    return model


def wants_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    return stream


def client_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ApiError(400, "'cache_salt' must be a string", param="cache_salt", code="invalid_type")
    return salt
