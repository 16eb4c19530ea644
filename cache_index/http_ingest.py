"""KV events over HTTP, for engines that cannot reach the router's ZMQ subscriber.

The router mounts this as ``POST /kvgate/v1/events``. Two body forms, same sequence rules as ZMQ:

- ``Content-Type: application/msgpack`` (or ``application/x-msgpack``, ``application/octet-stream``): the body is
  the engine's msgpack ``KVEventBatch`` payload, byte for byte what it would publish on ZMQ; the replica and sequence
  number come from the ``X-Kvgate-Replica`` and ``X-Kvgate-Seq`` headers (optional ``X-Kvgate-Dp-Rank``);
- ``Content-Type: application/json``: ``{"replica": "r1", "seq": 7, "dp_rank": 0, "batch": [ts, events, dp_rank]}``
  with events in either engine encoding and raw-bytes hashes as base64 text; headers, when present, must agree.

HTTP has no replay channel, so a gap is handled at once as an unrepairable one: the replica's holdings are purged
and the posted frame is applied as the stream's new start (the gap and the purge are counted).
"""

from __future__ import annotations

import msgspec

from kvgate.cache_index.events import DecodedBatch, MalformedBatch, decode_batch_object
from kvgate.cache_index.ingest import ApplyResult, ApplyStatus, EventIngestor

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/octet-stream")


class HttpIngestError(ValueError):
    """The request itself is unusable (missing replica or sequence number): answer 400 with this message."""


class _JsonEvents(msgspec.Struct):
    seq: int
    batch: msgspec.Raw
    replica: str | None = None
    dp_rank: int | None = None


def ingest_http(
    ingestor: EventIngestor,
    replica: str | None,
    body: bytes,
    content_type: str | None,
    *,
    seq: int | None = None,
    dp_rank: int | None = None,
) -> ApplyResult:
    """Apply one HTTP-posted batch. Raises :class:`HttpIngestError` for a request without replica or sequence."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == "application/json":
        try:
            message = msgspec.json.decode(body, type=_JsonEvents)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HttpIngestError(f"invalid JSON events body: {exc}") from exc
        if replica is not None and message.replica is not None and replica != message.replica:
            raise HttpIngestError("X-Kvgate-Replica and body replica differ")
        if seq is not None and seq != message.seq:
            raise HttpIngestError("X-Kvgate-Seq and body seq differ")
        name = replica or message.replica
        if name is None:
            raise HttpIngestError("no replica: send X-Kvgate-Replica or a body 'replica'")
        try:
            batch: DecodedBatch | bytes = decode_batch_object(msgspec.json.decode(message.batch))
        except (MalformedBatch, msgspec.DecodeError):
            batch = b""  # an empty payload is malformed by definition: the frame still takes its place in the sequence
        return _apply(ingestor, name, message.seq, batch, _rank(dp_rank, message.dp_rank))
    if media_type in MSGPACK_TYPES:
        if replica is None or seq is None:
            raise HttpIngestError("msgpack events need X-Kvgate-Replica and X-Kvgate-Seq headers")
        return _apply(ingestor, replica, seq, body, dp_rank)
    raise HttpIngestError(f"unsupported content type {content_type!r}: use application/msgpack or application/json")


def _apply(
    ingestor: EventIngestor, name: str, seq: int, payload: DecodedBatch | bytes, dp_rank: int | None
) -> ApplyResult:
    result = ingestor.apply(name, seq, payload, dp_rank, source="http")
    if result.status is ApplyStatus.GAP:
        ingestor.purge(name, dp_rank)
        result = ingestor.apply(name, seq, payload, dp_rank, source="http")
    return result


def _rank(header: int | None, body: int | None) -> int | None:
    return header if header is not None else body
