"""W3C Trace Context: a client's ``traceparent`` and ``tracestate`` headers, read as hostile input, and what an engine
attempt's span must offer the proxy that sends it.

A header is taken only in the exact form the Recommendation gives, or dropped: a gateway that forwards a malformed
trace context would break the trace further down, or carry a client's junk into the engine's headers and logs.

- ``traceparent`` version ``00`` is exactly ``00-<trace id: 32 lowercase hex>-<parent id: 16 lowercase hex>-<flags: 2
  lowercase hex>``, neither id all zeros. A higher version (``01`` to ``fe``; ``ff`` is invalid) is read by the
  forward-compatibility rule: the same first 55 characters, then nothing or ``-`` and more, of which only the sampled
  flag is understood. A header sent twice is invalid (its values, joined with a comma, match neither form).
- ``tracestate`` is only read beside a valid ``traceparent``: at most 32 list members of ``key=value`` (keys and
  values as the Recommendation's grammar says), no key twice, at most 512 characters in all; several headers are one
  list, joined with commas.

Nothing here imports OpenTelemetry: with tracing off the gateway still passes a valid client context on unchanged
(:func:`kvgate.router.pipeline.admit.upstream_headers`), and that costs nothing when a request carries none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_VERSION_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_LATER_VERSION = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-[\x21-\x2b\x2d-\x7e]*)?")
"""A version above ``00``: its first 55 characters as version 00's, then nothing or a dash and visible characters
(no comma, which is how a header sent twice arrives)."""
MAX_TRACEPARENT_CHARS = 256
"""A later version may add fields; beyond this the header is dropped rather than copied to every engine request."""
SAMPLED = 0x01

_KEY = re.compile(
    r"[a-z][a-z0-9_\-*/]{0,255}"  # a simple key
    r"|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}"  # a multi-tenant key: tenant@system
)
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
MAX_TRACESTATE_MEMBERS = 32
MAX_TRACESTATE_CHARS = 512


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid ``traceparent``: the ids as numbers, the flags this version defines, and the header as it came."""

    trace_id: int
    parent_id: int
    flags: int
    """Version 00: all eight bits as sent; a later version: only the sampled bit, the one flag it is known to mean."""
    header: str

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse_traceparent(value: str | None) -> TraceParent | None:
    """``value`` as a W3C ``traceparent``, or None when it is absent or not exactly valid. Never raises."""
    if value is None or len(value) > MAX_TRACEPARENT_CHARS:
        return None
    match = _VERSION_00.fullmatch(value)
    if match is not None:
        trace_id, parent_id, flags = match.groups()
        flag_bits = int(flags, 16)
    else:
        match = _LATER_VERSION.fullmatch(value)
        if match is None or match.group(1) in ("00", "ff"):
            return None
        _, trace_id, parent_id, flags = match.groups()
        flag_bits = int(flags, 16) & SAMPLED
    trace, parent = int(trace_id, 16), int(parent_id, 16)
    if trace == 0 or parent == 0:
        return None
    return TraceParent(trace, parent, flag_bits, value)


def valid_tracestate(value: str | None) -> bool:
    """Whether ``value`` is a W3C ``tracestate`` within the limits: list members ``key=value`` separated by commas
    (spaces and tabs around them, and empty members, allowed), at most 32 of them, no key twice, at most 512
    characters. Never raises."""
    if value is None or len(value) > MAX_TRACESTATE_CHARS:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        key, equals, member_value = member.partition("=")
        if not equals or _KEY.fullmatch(key) is None or _VALUE.fullmatch(member_value) is None or key in keys:
            return False
        keys.add(key)
    return 0 < len(keys) <= MAX_TRACESTATE_MEMBERS


def client_trace_context(
    traceparent: str | None, tracestate: str | None
) -> tuple[TraceParent | None, str | None]:
    """The client's trace context as kvgate may use it: a valid ``traceparent``, and its ``tracestate`` when that is
    valid too (a ``tracestate`` is never read without a valid ``traceparent``)."""
    parent = parse_traceparent(traceparent)
    if parent is None:
        return None, None
    return parent, tracestate if valid_tracestate(tracestate) else None


class TracedAttempt(Protocol):
    """One attempt's span (an engine request), told by the proxy how the attempt went."""

    def headers(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with this span's ``traceparent`` (and the trace's ``tracestate``): the engine continues the
        trace as a child of this attempt."""
        ...

    def answered(self, status: int, streaming: bool) -> None:
        """The engine answered: with ``streaming``, its first output has arrived and the span stays open until the
        stream ends; otherwise the answer was read whole and the span ends."""
        ...

    def failed(self, cause: str, status: int | None) -> None:
        """The attempt failed before any byte reached the client (``cause`` as the retry rules name it)."""
        ...

    def abandoned(self) -> None:
        """The attempt was cancelled (the client left, or a handoff no longer needs this leg)."""
        ...


class AttemptTracing(Protocol):
    """A traced request, as its engine attempts see it: each one gets its own span."""

    def attempt(self, url: str, method: str) -> TracedAttempt: ...
