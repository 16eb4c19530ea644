"""An answer's status line and headers leave with its first body bytes: one write for the two."""

from __future__ import annotations

from kvgate.router.app.protocol import HeadWithBody


class Transport:
    """Records what reaches the socket, one entry per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def writelines(self, lines: list[bytes]) -> None:
        self.calls.append(("writelines", b"".join(lines)))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def holding(transport: Transport, head: bytes) -> HeadWithBody:
    """``transport`` behind a :class:`HeadWithBody` to which uvicorn has written ``head`` for a response's start."""
    out = HeadWithBody(transport)  # type: ignore[arg-type]
    out.holding = True
    out.write(head)
    out.holding = False
    return out


def test_the_head_waits_for_the_first_body_bytes_and_goes_with_them() -> None:
    transport = Transport()
    out = holding(transport, b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.calls == []
    out.write(b"first")
    out.write(b"second")
    assert transport.calls == [("writelines", b"HTTP/1.1 200 OK\r\n\r\nfirst"), ("write", b"second")]


def test_a_head_with_no_body_goes_on_flush_or_close() -> None:
    transport = Transport()
    out = holding(transport, b"HTTP/1.1 204 No Content\r\n\r\n")
    out.flush()
    out.flush()
    assert transport.calls == [("writelines", b"HTTP/1.1 204 No Content\r\n\r\n")]

    closing = Transport()
    out = holding(closing, b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    out.close()
    assert closing.calls == [("writelines", b"HTTP/1.1 500 Internal Server Error\r\n\r\n")] and closing.is_closing()
