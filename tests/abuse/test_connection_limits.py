"""Connection-level abuse, with no credentials: oversized or countless headers get a 431 without holding the loop, a
body trickled after an early answer never holds the connection, and malformed HTTP gets an OpenAI-style JSON 400.
With credentials: a body whose chunked framing breaks is a 400 in its API's shape, another transfer coding a 501.

Each hostile client is a raw socket, as an attacker's would be; the gateway has tenants, so an unauthenticated POST
is answered (401) before its body is read."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.loadgen.bench import free_port_block
from kvgate.loadgen.procs import ChildProcess
from tests.abuse.support import gateway_config, without_blocking_the_loop
from tests.support import KVGATE, Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

TENANTS = {"api_keys": {"sk-alice": "alice"}, "salt_secret": "connection-limits-test-secret"}
ALICE = {"authorization": "Bearer sk-alice"}
LINGER_DEADLINE_S = 6.0
"""A connection answered before its body arrived is closed by then (2 s of lingering, the rest a loaded machine's
slack); before, it stayed open for as long as the client trickled."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("connection-limits")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 1, "--time-scale", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "k.yaml", tenants=TENANTS))
    yield g
    g.stop()


def exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` (in a thread, so a server that stops reading cannot block the test) and read until the server
    closes; what it answered."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def send() -> None:
        try:
            conn.sendall(data)
        except OSError:  # the server refused early and closed: expected for oversized requests
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received = b""
    try:
        while chunk := conn.recv(65536):
            received += chunk
    except OSError:
        pass
    finally:
        sender.join(timeout)
        conn.close()
    return received


def status_and_error(raw: bytes) -> tuple[int, str, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.decode().lower().split(": ", 1) for line in lines[1:])
    return status, headers.get("content-type", ""), json.loads(body)["error"]


@pytest.mark.parametrize("size", [1 << 20, 64 << 20])
def test_an_oversized_header_is_a_431_without_holding_the_loop(gw: Gateway, size: int) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * size + b"\r\n\r\n"
    started = time.monotonic()
    raw = without_blocking_the_loop(gw.url, lambda: exchange(gw.port, request))
    status, content_type, error = status_and_error(raw)
    assert (status, content_type) == (431, "application/json")
    assert error["code"] == "request_header_fields_too_large"
    assert time.monotonic() - started < 5  # before, 64 MiB took 6 s to be answered 200


def test_ten_thousand_headers_are_a_431(gw: Gateway) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: a\r\n" % i for i in range(10_000)) + b"\r\n"
    raw = without_blocking_the_loop(gw.url, lambda: exchange(gw.port, request))
    status, _, error = status_and_error(raw)
    assert status == 431 and "header lines" in error["message"]


def test_headers_within_the_limits_are_served(gw: Gateway) -> None:
    headers = {f"x-extra-{i}": "v" * 500 for i in range(80)}  # 80 lines, ~42 KB: under both limits
    assert httpx.get(gw.url + "/health", headers=headers, timeout=5).status_code == 200


def test_malformed_http_is_a_json_400(gw: Gateway) -> None:
    status, content_type, error = status_and_error(exchange(gw.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert (status, content_type, error["code"]) == (400, "application/json", "invalid_http_request")


def chunked_request(path: str, chunks: bytes, transfer_encoding: bytes = b"chunked") -> bytes:
    """An authenticated POST of ``path``, the connection closed after it, with a body framed by ``chunks`` as given
    (well-formed or not)."""
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alice\r\n"
            b"connection: close\r\ncontent-type: application/json\r\ntransfer-encoding: " + transfer_encoding
            + b"\r\n\r\n" + chunks)


def chunked(body: bytes) -> bytes:
    """``body`` as one chunk (with an extension, which a reader must skip) and the last chunk."""
    return b"%x;ext=1\r\n%s\r\n0\r\n\r\n" % (len(body), body)


COMPLETION = b'{"model": "kvgate-sim", "prompt": "hi", "max_tokens": 1}'
MESSAGE = b'{"model": "kvgate-sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}'


def test_a_well_formed_chunked_body_is_served(gw: Gateway) -> None:
    raw = exchange(gw.port, chunked_request("/v1/completions", chunked(COMPLETION)))
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/messages", MESSAGE)],
                         ids=["completions", "messages"])
def test_a_malformed_chunked_body_is_a_400_in_the_apis_shape_then_closed(gw: Gateway, path: str, body: bytes) -> None:
    raw = exchange(gw.port, chunked_request(path, b"zz\r\n" + body + b"\r\n0\r\n\r\n"))
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(answer)
    if path == "/v1/messages":
        assert (error["type"], error["error"]["type"]) == ("error", "invalid_request_error"), error
    else:
        assert error["error"]["code"] == "invalid_http_request", error
    assert "chunked" in json.dumps(error)
    assert httpx.get(gw.url + "/health", timeout=5).status_code == 200


def test_a_transfer_coding_other_than_chunked_is_a_501(gw: Gateway) -> None:
    raw = exchange(gw.port, chunked_request("/v1/completions", chunked(COMPLETION), b"gzip, chunked"))
    status, content_type, error = status_and_error(raw)
    assert (status, content_type, error["code"]) == (501, "application/json", "unsupported_transfer_coding")


class Trickler:
    """A connection that sends a request's head, then one byte of body every ``interval_s``; records whether and
    when the server closed it (a read of EOF or a reset, or a send that fails)."""

    def __init__(self, port: int, head: bytes, interval_s: float = 0.2) -> None:
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn.sendall(head)
        self.conn.setblocking(False)
        self.interval_s = interval_s
        self.opened_at = time.monotonic()
        self.answer = b""
        self.closed_after: float | None = None

    def step(self) -> None:
        if self.closed_after is not None:
            return
        try:
            chunk = self.conn.recv(65536)
            if chunk:
                self.answer += chunk
        except BlockingIOError:
            pass
        except OSError:
            self.closed_after = time.monotonic() - self.opened_at
            return
        try:
            self.conn.send(b"a")
        except BlockingIOError:
            pass
        except OSError:
            self.closed_after = time.monotonic() - self.opened_at

    def close(self) -> None:
        self.conn.close()


def trickle_until_closed(tricklers: list[Trickler], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and any(t.closed_after is None for t in tricklers):
        for t in tricklers:
            t.step()
        time.sleep(tricklers[0].interval_s)


HEADS = {
    "unauthenticated POST": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n"
                            b"content-type: application/json\r\n\r\n",
    "GET with a body": b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n",
    "GET with a chunked body": b"GET /health HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nfffffff\r\n",
}


@pytest.mark.parametrize("kind", list(HEADS))
def test_a_trickled_body_after_an_early_answer_does_not_hold_the_connection(gw: Gateway, kind: str) -> None:
    t = Trickler(gw.port, HEADS[kind])
    try:
        trickle_until_closed([t], LINGER_DEADLINE_S)
        assert t.closed_after is not None, "the connection was still open"
        assert t.answer.startswith(b"HTTP/1.1 401" if kind.startswith("unauth") else b"HTTP/1.1 200"), t.answer[:80]
    finally:
        t.close()


def test_an_authenticated_trickled_body_is_a_408_then_closed(sim: Sim, workdir: Path) -> None:
    config = gateway_config(sim, workdir, "short-body.yaml", tenants=TENANTS, server={"body_timeout_s": 1.0})
    g = start_kvgate(workdir, config)
    try:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alice\r\n"
                b"content-length: 1000\r\ncontent-type: application/json\r\n\r\n")
        t = Trickler(g.port, head)
        try:
            trickle_until_closed([t], 1.0 + LINGER_DEADLINE_S)
            assert t.closed_after is not None and t.answer.startswith(b"HTTP/1.1 408"), t.answer[:80]
        finally:
            t.close()
    finally:
        g.stop()


def test_trickling_connections_cannot_exhaust_a_small_descriptor_limit(sim: Sim, workdir: Path) -> None:
    """The finding: with 200 file descriptors, 190 trickling connections failed every other request for 45 s."""
    config = gateway_config(sim, workdir, "fd-limited.yaml", tenants=TENANTS)
    port = free_port_block(1)
    process = ChildProcess("kvgate serve (200 descriptors)", ["prlimit", "--nofile=200", "--", *KVGATE, "serve",
                           "--config", str(config), "--port", str(port)], workdir / f"kvgate-{port}.log").start()
    try:
        url = f"http://127.0.0.1:{port}"
        process.wait_http(url + "/health", 30)
        attack = [Trickler(port, HEADS["unauthenticated POST"]) for _ in range(150)]
        try:
            trickle_until_closed(attack, 2.0)  # every attacker holds its connection while it can
            client = httpx.Client(timeout=2)

            def served() -> bool:
                try:
                    return client.get(url + "/v1/models", headers=ALICE).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(served, "a legitimate request answered", timeout=LINGER_DEADLINE_S)
            trickle_until_closed(attack, LINGER_DEADLINE_S)
            assert all(t.closed_after is not None for t in attack)
        finally:
            for t in attack:
                t.close()
    finally:
        process.stop()
