"""A replica that accepts connections and never answers costs a request about one first-byte deadline (the cost
model's predicted TTFT, within a floor), not the flat cap: the request is retried on the other replica, the timeouts
open the black hole's breaker and are counted, and once its health checks stop answering too it is marked down."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.abuse.support import gateway_config
from tests.support import Gateway, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN = "admin-token-for-tests"
CLIENT_TIMEOUT_S = 10.0
"""Far below the 60 s cap a request sent to the black hole waited before, far above the 0.5 s deadline here."""


class BlackHole(ThreadingHTTPServer):
    """A loopback server that reads requests and never answers them. Until ``silence()`` it still answers its
    health checks and model list, as a hung engine behind a live API server does; after it, nothing at all."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _BlackHoleHandler)
        self.released = threading.Event()
        self.silent = threading.Event()
        self.generation_requests = 0
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def silence(self) -> None:
        self.silent.set()

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()  # let every held handler thread end
        self.shutdown()
        self.server_close()


class _BlackHoleHandler(BaseHTTPRequestHandler):
    server: BlackHole

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.server.silent.is_set():
            self.server.released.wait()
            return
        if self.path == "/health":
            self._answer({})
        elif self.path == "/v1/models":
            self._answer({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]})
        else:
            self.send_error(404)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.generation_requests += 1
        self.server.released.wait()

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def replica_status(gw: Gateway, name: str) -> dict[str, Any]:
    replicas = httpx.get(gw.url + "/admin/replicas", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()
    return next(r for r in replicas["data"] if r["name"] == name)


def timeouts_counted(gw: Gateway, replica: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    wanted = ("kvgate_upstream_failures_total{", 'cause="timeout"', f'replica="{replica}"')
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if all(w in line for w in wanted))


def wait_until(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    with BlackHole() as hole:
        yield hole


def test_a_black_holed_replica_costs_a_request_one_short_deadline(tmp_path: Path, black_hole: BlackHole) -> None:
    sim = start_sim(tmp_path, 1, "--time-scale", "0")
    try:
        config = gateway_config(
            sim, tmp_path, "k.yaml",
            server={"admin_token": ADMIN},
            proxy={"first_byte_floor_s": 0.5, "first_byte_ttft_multiplier": 10, "first_byte_ms_per_output_token": 10},
            breaker={"failures_to_open": 2, "open_s": 60},
        )
        policy = yaml.safe_load(config.read_text())
        policy["replicas"].append({"name": "blackhole", "url": black_hole.url})
        config.write_text(yaml.safe_dump(policy))
        gw = start_kvgate(tmp_path, config)
        try:
            wait_until(lambda: replica_status(gw, "blackhole")["routable"], 10)
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
            sent = 0
            while replica_status(gw, "blackhole")["breaker"] != "open":
                assert sent < 40, "the black hole's breaker never opened"
                messages = [{"role": "user", "content": f"question {sent}: what is a black hole?"}]
                if sent % 2:
                    raw = client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=messages, max_tokens=8, stream=True
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
                else:
                    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)
                    text = raw.parse().choices[0].message.content or ""
                assert raw.headers["x-kvgate-replica"] == "sim-0" and text
                sent += 1
            assert black_hole.generation_requests >= 2
            assert timeouts_counted(gw, "blackhole") >= 2
            assert replica_status(gw, "blackhole")["healthy"]  # its health checks still answer

            black_hole.silence()  # now its /health hangs too: the probe's own timeout marks it down
            wait_until(lambda: not replica_status(gw, "blackhole")["healthy"], 10)
        finally:
            gw.stop()
    finally:
        sim.stop()
