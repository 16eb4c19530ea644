"""``POST /kvgate/v1/events``: KV events over HTTP, for engines that cannot reach kvgate over ZMQ (same sequence
rules, :mod:`kvgate.cache_index.http_ingest`). Off unless an events token is configured, and then only for callers
presenting it (it writes the index). A body is bounded in bytes and blocks and decoded off the event loop."""

from __future__ import annotations

import asyncio
import functools
from typing import Any


from kvgate.cache_index.http_ingest import HttpIngestError, apply_http_frame, decode_http_frame
from kvgate.cache_index.ingest import EventIngestor
from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest
from kvgate.router.endpoints.callers import Callers
from kvgate.router.pipeline.bodies import read_body
from kvgate.router.settings.holder import ConfigHolder


class EventIngest:
    def __init__(self, holder: ConfigHolder, callers: Callers, ingestor: EventIngestor) -> None:
        self.holder = holder
        self.callers = callers
        self.ingestor = ingestor

    async def __call__(self, request: HttpRequest) -> dict[str, Any]:
        self.callers.credentials.require_events(request.header("authorization"))
        server = self.holder.current.server
        raw = await read_body(request, server.max_event_body_bytes, server.body_timeout_s, None)
        decode = functools.partial(
            decode_http_frame, request.header("x-kvgate-replica"), raw, request.header("content-type"),
            seq=_int_header(request, "x-kvgate-seq"), dp_rank=_int_header(request, "x-kvgate-dp-rank"),
        )
        try:  # decoding is pure: off the loop, which applying (bounded below) is not
            frame = await asyncio.get_running_loop().run_in_executor(None, decode)
        except HttpIngestError as e:
            raise ApiError(400, str(e), code="invalid_events") from e
        if frame.blocks > server.max_event_blocks:
            raise ApiError(413, f"the batch holds {frame.blocks} blocks; the limit is {server.max_event_blocks} "
                           "(split it, one sequence number each)", code="request_too_large")
        result = apply_http_frame(self.ingestor, frame)
        return {"status": result.status.name.lower(), "events": result.events}


def _int_header(request: HttpRequest, name: str) -> int | None:
    value = request.header(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"header {name} must be an integer", param=name, code="invalid_header") from None
