"""Server-sent events as the APIs with named events write them (Anthropic Messages, OpenAI Responses): each event an
``event:`` line and a ``data:`` line, events separated by a blank line."""

from __future__ import annotations

from collections.abc import Iterator


FIELDS = (b"event:", b"data:", b"id:", b"retry:", b":")


def complete_events(buffer: bytes, *, tail: bool = False) -> Iterator[tuple[bytes, bytes]]:
    """The (event name, data) of each event in ``buffer`` that a blank line ends, in order; one cut off at the
    buffer's end is left out. A data field spread over several lines is joined with newlines, as the SSE standard
    says. With ``tail`` (the buffer is a stream's end), the first event may have been cut at its start: it comes
    without its name, and the rest of a data line cut short counts as its data."""
    events = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    for i, chunk in enumerate(events[:-1]):
        name = b""
        data: list[bytes] = []
        for j, line in enumerate(chunk.split(b"\n")):
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" "))
            elif tail and i == 0 and j == 0 and not line.startswith(FIELDS):
                data.append(line)
        if data:
            yield name, b"\n".join(data)


def event(name: str, data: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"
