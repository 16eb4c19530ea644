"""KV events over HTTP, for engines that cannot reach the router's ZMQ subscriber.

The router mounts this as ``POST /kvgate/v1/events``. Two body forms, same sequence rules as ZMQ:

- ``Content-Type: application/msgpack`` (or ``application/x-msgpack``, ``application/octet-stream``): the body is
  the engine's msgpack ``KVEventBatch`` payload, byte for byte what it would publish on ZMQ; the replica and sequence
  number come from the ``X-Kvgate-Replica`` and ``X-Kvgate-Seq`` headers (optional ``X-Kvgate-Dp-Rank``);
- ``Content-Type: application/json``: ``{"replica": "r1", "seq": 7, "dp_rank": 0, "batch": [ts, events, dp_rank]}``
  with events in either engine encoding and raw-bytes hashes as base64 text; headers, when present, must agree.

HTTP has no replay channel, so a gap is handled at once as an unrepairable one: the replica's holdings are purged
and the posted frame is applied as the stream's new start (the gap and the purge are counted).

Decoding (:func:`decode_http_frame`) is pure and separate from applying (:func:`apply_http_frame`), so the gateway
decodes a posted body off its event loop and bounds what it applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvgate.cache_index.events import Cleared, DecodedBatch, MalformedBatch, decode_batch, decode_batch_object
from kvgate.cache_index.ingest import ApplyResult, ApplyStatus, EventIngestor

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/octet-stream")


class HttpIngestError(ValueError):
    """The request itself is unusable (missing replica or sequence number): answer 400 with this message."""


class _JsonEvents(msgspec.Struct):
    seq: int
    batch: msgspec.Raw
    replica: str | None = None
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class HttpFrame:
    """One posted frame, decoded: whose stream it belongs to, its sequence number, and its batch (``b""`` when the
    payload is malformed: the frame still takes its place in the sequence)."""

    replica: str
    seq: int
    batch: DecodedBatch | bytes
    dp_rank: int | None

    @property
    def blocks(self) -> int:
        """Block hashes the frame stores or removes: what applying it costs."""
        if not isinstance(self.batch, DecodedBatch):
            return 0
        return sum(len(event.block_hashes) for event in self.batch.events if not isinstance(event, Cleared))


def ingest_http(
    ingestor: EventIngestor,
    replica: str | None,
    body: bytes,
    content_type: str | None,
    *,
    seq: int | None = None,
    dp_rank: int | None = None,
) -> ApplyResult:
    """Decode and apply one HTTP-posted batch (:func:`decode_http_frame`, then :func:`apply_http_frame`)."""
    return apply_http_frame(ingestor, decode_http_frame(replica, body, content_type, seq=seq, dp_rank=dp_rank))


def decode_http_frame(
    replica: str | None, body: bytes, content_type: str | None, *, seq: int | None = None, dp_rank: int | None = None
) -> HttpFrame:
    """One posted batch, decoded; pure, so a caller may run it off its event loop. Raises :class:`HttpIngestError`
    for a request without replica or sequence number, or a JSON body that is not one."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == "application/json":
        try:
            message = msgspec.json.decode(body, type=_JsonEvents)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise HttpIngestError(f"invalid JSON events body: {str(exc)[:200]}") from exc
        if replica is not None and message.replica is not None and replica != message.replica:
            raise HttpIngestError("X-Kvgate-Replica and body replica differ")
        if seq is not None and seq != message.seq:
            raise HttpIngestError("X-Kvgate-Seq and body seq differ")
        name = replica or message.replica
        if name is None:
            raise HttpIngestError("no replica: send X-Kvgate-Replica or a body 'replica'")
        try:
            batch: DecodedBatch | bytes = decode_batch_object(msgspec.json.decode(message.batch))
        except (MalformedBatch, msgspec.DecodeError, RecursionError):
            batch = b""  # an empty payload is malformed by definition: the frame still takes its place in the sequence
        return HttpFrame(name, message.seq, batch, _rank(dp_rank, message.dp_rank))
    if media_type in MSGPACK_TYPES:
        if replica is None or seq is None:
            raise HttpIngestError("msgpack events need X-Kvgate-Replica and X-Kvgate-Seq headers")
        try:
            return HttpFrame(replica, seq, decode_batch(body), dp_rank)
        except MalformedBatch:
            return HttpFrame(replica, seq, b"", dp_rank)
    raise HttpIngestError(f"unsupported content type {content_type!r}: use application/msgpack or application/json")


def apply_http_frame(ingestor: EventIngestor, frame: HttpFrame) -> ApplyResult:
    """Apply a decoded frame under the sequence rules; a gap purges the replica's holdings first (HTTP has no
    replay)."""
    result = ingestor.apply(frame.replica, frame.seq, frame.batch, frame.dp_rank, source="http")
    if result.status is ApplyStatus.GAP:
        ingestor.purge(frame.replica, frame.dp_rank)
        result = ingestor.apply(frame.replica, frame.seq, frame.batch, frame.dp_rank, source="http")
    return result


def _rank(header: int | None, body: int | None) -> int | None:
    return header if header is not None else body
