"""Idle client connections are closed after ``server.keep_alive_timeout_s``."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.abuse.support import gateway_config
from tests.support import start_kvgate, start_sim

pytestmark = pytest.mark.integration


def read_response(conn: socket.socket) -> bytes:
    """One whole HTTP response with a content-length (the server writes its head and body separately, and a loaded
    machine may deliver them in separate reads)."""
    data = b""
    while True:
        head, found, body = data.partition(b"\r\n\r\n")
        if found:
            lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")]
            if len(body) >= int(lengths[0]):
                return data
        chunk = conn.recv(4096)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, 1, "--time-scale", "0")
    try:
        gw = start_kvgate(tmp_path, gateway_config(sim, tmp_path, "k.yaml", server={"keep_alive_timeout_s": 0.5}))
        try:
            with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                assert b" 200 " in read_response(conn)
                started = time.monotonic()
                assert conn.recv(4096) == b""  # closed by the server
                assert time.monotonic() - started < 3.0
        finally:
            gw.stop()
    finally:
        sim.stop()


def test_clients_and_their_load_balancers_close_idle_connections_before_kvgate_does() -> None:
    """A server that closes an idle connection first can close it just as the client sends a request on it: the
    client gets a reset for a request the gateway never read. The official SDKs (httpx underneath), aiohttp and cloud
    load balancers (60 s) all give up their idle connections sooner than kvgate does by default."""
    import inspect

    import aiohttp
    import anthropic._constants
    import openai._constants

    from kvgate.router.core.config import ServerConfig

    aiohttp_idle_s = 15.0  # aiohttp's keepalive_timeout when none is given (its signature holds a sentinel)
    assert "keepalive_timeout" in inspect.signature(aiohttp.TCPConnector.__init__).parameters
    client_idle_s = [
        openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
        anthropic._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
        aiohttp_idle_s,
        60.0,
    ]
    assert all(s is not None and s < ServerConfig().keep_alive_timeout_s for s in client_idle_s)
