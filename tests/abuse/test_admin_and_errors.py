"""The admin surface takes bounded, well-formed bodies and valid URLs, drained replicas can be undrained, and every
error a client gets is JSON in OpenAI's shape, an engine's plain-text error included."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.abuse.support import assert_openai_error, gateway_config
from tests.support import Gateway, Sim, admin_replicas, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN_TOKEN = "admin-token-for-tests"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("admin-errors"), 1, "--time-scale", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("admin-errors-gw")
    g = start_kvgate(workdir, gateway_config(sim, workdir, "k.yaml", server={"admin_token": ADMIN_TOKEN}))
    yield g
    g.stop()


def add_replica(gw: Gateway, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gw.url + "/admin/replicas", content=raw,
                      headers={**ADMIN, "content-type": "application/json"}, timeout=10)


def test_a_deeply_nested_admin_body_is_a_400(gw: Gateway) -> None:
    assert_openai_error(add_replica(gw, b"[" * 30_000 + b"]" * 30_000), 400, "invalid_json")


def test_an_oversized_admin_body_is_a_413(gw: Gateway) -> None:
    body = {"name": "big", "url": "http://127.0.0.1:9", "labels": {"padding": "x" * 200_000}}
    assert_openai_error(add_replica(gw, body), 413, "request_too_large")


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://", "http://host:0",
                                 "http://user:password@127.0.0.1:9"])
def test_malformed_replica_urls_are_refused(gw: Gateway, url: str) -> None:
    error = assert_openai_error(add_replica(gw, {"name": "bad-url", "url": url}), 422, "invalid_value")
    assert error["message"].startswith("url:")
    assert "bad-url" not in admin_replicas(gw, ADMIN_TOKEN)


def test_a_drained_replica_can_be_undrained(gw: Gateway) -> None:
    for action, draining in (("drain", True), ("undrain", False)):
        response = httpx.post(gw.url + f"/admin/replicas/sim-0/{action}", headers=ADMIN, timeout=5)
        assert response.status_code == 200 and response.json()["draining"] is draining
    assert admin_replicas(gw, ADMIN_TOKEN)["sim-0"]["routable"]
    assert_openai_error(httpx.post(gw.url + "/admin/replicas/nobody/undrain", headers=ADMIN, timeout=5), 404,
                        "replica_not_found")


class PlainTextEngine(ThreadingHTTPServer):
    """An engine whose generation endpoints fail with a plain-text 500 (a crashed handler behind a bare server)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _PlainTextHandler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _PlainTextHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = {"object": "list", "data": [{"id": MODEL, "object": "model"}]} if self.path == "/v1/models" else {}
        self._send(200, json.dumps(body).encode(), "application/json")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(500, b"Internal Server Error\nTraceback (most recent call last): /srv/engine/secret.py", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_an_engines_plain_text_error_reaches_the_client_as_json(sim: Sim, tmp_path: Path) -> None:
    engine = PlainTextEngine()
    try:
        config = yaml.safe_load(sim.config_path.read_text())
        config["replicas"] = [{"name": "plain", "url": engine.url}]
        path = tmp_path / "plain.yaml"
        path.write_text(yaml.safe_dump(config))
        g = start_kvgate(tmp_path, path)
        try:
            response = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
            error = assert_openai_error(response, 500, "upstream_error")
            assert response.headers["content-type"] == "application/json"
            assert "secret.py" not in error["message"]
        finally:
            g.stop()
    finally:
        engine.shutdown()
        engine.server_close()
