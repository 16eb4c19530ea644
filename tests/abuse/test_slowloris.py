"""Slowloris: connections that send their request headers a byte at a time are closed after
``server.header_timeout_s``, and a normal client's request meanwhile is answered at once."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.abuse.support import gateway_config
from tests.support import start_kvgate, start_sim

pytestmark = pytest.mark.integration

CONNECTIONS = 200
HEADER_TIMEOUT_S = 1.0
CLOSE_DEADLINE_S = HEADER_TIMEOUT_S + 5.0
"""Every slow connection must be closed by then (a loaded machine gets seconds of slack; before, they stayed open)."""
TRICKLE_INTERVAL_S = 0.2


class Slowloris:
    """``CONNECTIONS`` connections that each send a partial request, then one more header byte every
    ``TRICKLE_INTERVAL_S``, from one thread; records when the server closed each."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.opened_at = time.monotonic()
        self.closed_after: dict[int, float] = {}
        self.sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Slowloris:
        for _ in range(CONNECTIONS):
            conn = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
            conn.setblocking(False)
            self.sockets.append(conn)
        self.opened_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn in self.sockets:
            conn.close()

    def all_closed(self) -> bool:
        return len(self.closed_after) == len(self.sockets)

    def _run(self) -> None:
        while not self._stop.is_set() and not self.all_closed():
            open_now = [c for c in self.sockets if c.fileno() not in self.closed_after]
            readable, _, _ = select.select(open_now, [], [], 0)
            for conn in open_now:
                if conn in readable:
                    try:
                        closed = conn.recv(4096) == b""
                    except OSError:
                        closed = True
                else:
                    try:
                        conn.send(b"a")
                        closed = False
                    except OSError:
                        closed = True
                if closed:
                    self.closed_after[conn.fileno()] = time.monotonic() - self.opened_at
            self._stop.wait(TRICKLE_INTERVAL_S)


def test_slowloris_connections_are_closed_and_others_are_served(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, 1, "--time-scale", "0")
    try:
        config = gateway_config(sim, tmp_path, "k.yaml", server={"header_timeout_s": HEADER_TIMEOUT_S})
        gw = start_kvgate(tmp_path, config)
        try:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=5)
            with Slowloris(gw.port) as attack:
                answer = client.chat.completions.create(
                    model="kvgate-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
                assert answer.choices[0].message.content
                deadline = time.monotonic() + CLOSE_DEADLINE_S
                while not attack.all_closed() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert attack.all_closed(), f"{len(attack.closed_after)} of {CONNECTIONS} slow connections closed"
                assert min(attack.closed_after.values()) > HEADER_TIMEOUT_S * 0.5  # by the deadline, not at once
            # The server still serves new connections normally afterwards.
            again = client.chat.completions.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "again"}], max_tokens=4
            )
            assert again.choices[0].message.content
        finally:
            gw.stop()
    finally:
        sim.stop()
