"""Reading and validating request bodies (JSON, and the model field of a multipart form): once, cheaply, with errors
for client mistakes.

The gateway parses a body exactly once (msgspec) and checks only what routing needs; every other field passes through
to the engine unchanged, so the engine stays the judge of its own API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import msgspec
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import ClientLeft, HttpRequest, MalformedBody

log = logging.getLogger(__name__)

_decode = msgspec.json.Decoder().decode

COUNT_ITEMS_ABOVE_BYTES = 65536
"""Bodies up to this size cannot hold enough JSON values to matter: their bytes are not counted."""
_STRUCTURE_BYTES = b"{[,"


class JsonBounds(NamedTuple):
    """How much JSON a body may hold: values (its ``{``, ``[`` and ``,`` bytes, an upper bound of them) and objects
    (its ``{`` bytes: each costs the decoder a dict and its keys, several times a value in a list)."""

    items: int
    objects: int


async def read_body(request: HttpRequest, limit: int, timeout_s: float, bounds: JsonBounds | None) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes by Content-Length or by what actually arrives,
    and (408) a body that has not arrived in full within ``timeout_s``. A client that disconnects during the upload
    is a 499 for the request log: one line, no traceback.

    A body over :data:`COUNT_ITEMS_ABOVE_BYTES` beyond ``bounds`` is refused (413) as soon as a count passes its
    limit, chunk by chunk as it arrives: decoding builds every value on the event loop (msgspec holds the GIL, so no
    thread would help), so 800,000 tiny messages would hold it for seconds, and counting a whole body at once would
    hold it too. ``bounds=None`` (bodies that are not JSON) counts nothing. A body already in full (most are, by the
    time an endpoint reads them) is checked and joined without waiting."""
    declared = request.header("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    if request.complete:
        chunks = request.received()
        size = sum(map(len, chunks))
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        if bounds is not None and size > COUNT_ITEMS_ABOVE_BYTES:
            _check_bounds(_structure_bytes(chunks), sum(c.count(b"{") for c in chunks), bounds)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    chunks = []
    size = 0
    items = objects = -1  # not counted yet
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.chunks():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
                if bounds is not None and size > COUNT_ITEMS_ABOVE_BYTES:
                    counted = chunks if items < 0 else [chunk]
                    items = max(items, 0) + _structure_bytes(counted)
                    objects = max(objects, 0) + sum(c.count(b"{") for c in counted)
                    _check_bounds(items, objects, bounds)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", code="request_timeout") from None
    except MalformedBody:
        raise ApiError(400, "the request body's chunked framing is malformed", code="invalid_http_request") from None
    except ClientLeft:
        log.info("client disconnected during the request body upload (%d bytes received)", size)
        raise ApiError(499, "client disconnected during the upload", code="client_closed") from None
    return b"".join(chunks)


def _check_bounds(items: int, objects: int, bounds: JsonBounds) -> None:
    if items > bounds.items or objects > bounds.objects:
        what = (f"{bounds.items} JSON values (objects, arrays, elements)" if items > bounds.items
                else f"{bounds.objects} JSON objects")
        raise ApiError(413, f"request body holds more than {what}", code="request_too_complex")


def _structure_bytes(chunks: list[bytes]) -> int:
    return sum(len(chunk) - len(chunk.translate(None, _STRUCTURE_BYTES)) for chunk in chunks)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; nesting beyond the decoder's depth limit (~1,000 levels) is a 400 too."""
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


ENGINE_STEERING_FIELDS = frozenset({
    "kv_transfer_params", "ec_transfer_params",  # vLLM: where KV (encoder cache) is pulled from or kept for
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",  # SGLang: the P/D handshake's peer
    "session_params",  # SGLang: continue another request's KV
    "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank",  # SGLang: which data-parallel rank runs it
    "extra_key",  # SGLang: the prefix cache's namespace (kvgate's is cache_salt)
    "rid",  # SGLang: the request's id inside the engine (kvgate's is X-Request-Id)
    "lora_path",  # SGLang: an adapter loaded from a path on the engine's disk
    "custom_logit_processor",  # SGLang: serialised code the engine runs
})
"""Request fields that steer an engine's KV cache, its network connections, its placement or what it loads and runs.
They are kvgate's to set (transfers, disaggregation, tenants' namespaces), never a client's: a client's
``kv_transfer_params`` made an engine hold its KV blocks and hand back their ids and its side channel, and
``bootstrap_*`` fields make an SGLang engine connect where the client says."""
ENGINE_STEERING_XARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})
"""Keys of vLLM's ``vllm_xargs`` (passed into the sampling parameters' ``extra_args``, where vLLM's KV connectors
read ``kv_transfer_params`` too) that are kvgate's for the same reason."""


def refuse_engine_steering(body: dict[str, Any]) -> None:
    """A 400 (``forbidden_field``) for a client's body that sets one of :data:`ENGINE_STEERING_FIELDS` or
    :data:`ENGINE_STEERING_XARGS`, naming the field."""
    if not ENGINE_STEERING_FIELDS.isdisjoint(body):
        name = min(ENGINE_STEERING_FIELDS.intersection(body))
        raise ApiError(400, f"'{name}' is set by kvgate, not by clients", param=name, code="forbidden_field")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and not ENGINE_STEERING_XARGS.isdisjoint(xargs):
        name = "vllm_xargs." + min(ENGINE_STEERING_XARGS.intersection(xargs))
        raise ApiError(400, f"'{name}' is set by kvgate, not by clients", param=name, code="forbidden_field")


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


class _FieldFound(Exception):
    """Stops the multipart parser once the field looked for has been read."""


def form_field(raw: bytes, content_type: str, name: str, max_chars: int = 1024) -> str | None:
    """The value of the ``multipart/form-data`` field ``name`` of a body (None when it has none), read with the
    parser Starlette uses (python-multipart) and stopped as soon as the field ends: an upload's file parts after it
    are never looked at. A body that is no valid form, or a value over ``max_chars``, is a 400."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "a multipart/form-data body needs a boundary", param="content-type", code="invalid_body")
    header = bytearray()
    headers: dict[bytes, bytes] = {}
    wanted = False
    value = bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        headers[bytes(header).lower()] = headers.get(bytes(header).lower(), b"") + data[start:end]

    def on_header_end() -> None:
        header.clear()

    def on_headers_finished() -> None:
        nonlocal wanted
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        wanted = disposition.get(b"name") == name.encode()
        headers.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if wanted:
            value.extend(data[start:end])
            if len(value) > max_chars:
                raise ApiError(400, f"form field {name!r} is too long", param=name, code="invalid_body")

    def on_part_end() -> None:
        if wanted:
            raise _FieldFound

    parser = MultipartParser(boundary, {
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end,
    })
    try:
        parser.write(raw)
        parser.finalize()
    except _FieldFound:
        pass
    except MultipartParseError as e:
        raise ApiError(400, "the multipart/form-data body does not parse", code="invalid_body") from e
    if not wanted:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise ApiError(400, f"form field {name!r} is not UTF-8", param=name, code="invalid_body") from None


PRIORITY_RANGE = 2**31
"""A priority is a 32-bit signed integer, as vLLM's scheduler keeps it."""


def priority_of(value: object, param: str) -> int | None:
    """A request's priority (the body's ``priority`` field, or the ``X-Vllm-Priority`` header's text), or None when
    it names none; anything but an integer in range is an :class:`ApiError`."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            value = None
    if type(value) is not int or not -PRIORITY_RANGE <= value < PRIORITY_RANGE:
        raise ApiError(400, f"'{param}' must be an integer", param=param, code="invalid_value")
    return value
