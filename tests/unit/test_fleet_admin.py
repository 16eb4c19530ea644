"""The /admin API on an in-process app: token checks, replica add/drain/remove, reload accepted and rejected."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvgate.router.app.admin import Admin
from kvgate.router.app.routes import Routes
from kvgate.router.core.auth import ADMIN_TOKEN_ENV
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.state import Fleet
from kvgate.router.routing.config import ParityConfig
from kvgate.router.routing.parity import ParityMonitor
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.upstream.client import EngineClient
from tests.fleets import fleet_of, reconfigure
from tests.served import served

CONFIG = """\
server: {admin_token: s3cret}
replicas:
  - {name: a, url: 'http://127.0.0.1:9'}
"""
AUTH = {"Authorization": "Bearer s3cret"}


def parity() -> ParityMonitor:
    return ParityMonitor(ParityConfig(), GatewayMetrics())


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Fleet, ConfigHolder, Path]]:
    path = tmp_path / "kvgate.yaml"
    path.write_text(CONFIG)
    holder = ConfigHolder(path)
    engines = EngineClient(8)
    fleet = fleet_of(holder.current, engines)
    holder.subscribe(lambda config: reconfigure(fleet, config))
    await fleet.start()
    routes = Routes()
    Admin(fleet, holder, parity(), dict).add_routes(routes)
    try:
        async with served(routes) as url, httpx.AsyncClient(base_url=url) as client:
            yield client, fleet, holder, path
    finally:
        await fleet.stop()
        await engines.close()


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_token_required(admin) -> None:  # type: ignore[no-untyped-def]
    client, *_ = admin
    assert_openai_error(await client.get("/admin/replicas"), 401)
    assert_openai_error(await client.get("/admin/replicas", headers={"Authorization": "Bearer nope"}), 403)
    assert_openai_error(await client.post("/admin/replicas", content=b"{not json"), 401)  # auth before the body
    resp = await client.get("/admin/replicas", headers=AUTH)
    assert resp.status_code == 200
    (a,) = resp.json()["data"]
    assert a["name"] == "a" and a["healthy"] is False and a["breaker"] == "closed"
    assert (a["in_flight"], a["in_flight_prefilling"], a["in_flight_prefill_tokens"], a["arrival_rate_per_s"]) == (0, 0, 0, 0)


async def test_admin_off_without_token_is_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    path = tmp_path / "kvgate.yaml"
    path.write_text("replicas: [{name: a, url: 'http://127.0.0.1:9'}]\n")
    holder = ConfigHolder(path)
    routes = Routes()
    Admin(fleet_of(holder.current, EngineClient(8)), holder, parity(), dict).add_routes(routes)
    async with served(routes) as url, httpx.AsyncClient(base_url=url) as client:
        assert_openai_error(await client.get("/admin/replicas", headers=AUTH), 404)
        assert_openai_error(await client.get("/admin/state", headers=AUTH), 404)
        monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
        resp = await client.get("/admin/replicas", headers={"Authorization": "Bearer from-env"})
        assert resp.status_code == 200


async def test_add_drain_remove(admin) -> None:  # type: ignore[no-untyped-def]
    client, fleet, *_ = admin
    resp = await client.post("/admin/replicas", headers=AUTH, json={"name": "b", "url": "http://127.0.0.1:9/"})
    assert resp.status_code == 201 and resp.json()["url"] == "http://127.0.0.1:9"
    assert list(fleet.replicas) == ["a", "b"]
    assert_openai_error(await client.post("/admin/replicas", headers=AUTH, json={"name": "b", "url": "http://x"}), 409)
    err = assert_openai_error(await client.post("/admin/replicas", headers=AUTH, json={"name": "c", "url": "x"}), 422)
    assert "url" in err["message"]
    assert_openai_error(await client.post("/admin/replicas", headers=AUTH, content=b"{"), 400)
    resp = await client.post("/admin/replicas/b/drain", headers=AUTH)
    assert resp.status_code == 200 and resp.json()["draining"] is True
    assert fleet.replicas["b"].draining
    assert_openai_error(await client.post("/admin/replicas/zz/drain", headers=AUTH), 404)
    resp = await client.delete("/admin/replicas/b", headers=AUTH)
    assert resp.status_code == 200 and "b" not in fleet.replicas
    assert_openai_error(await client.delete("/admin/replicas/b", headers=AUTH), 404)


async def test_reload_accepted_then_rejected(admin) -> None:  # type: ignore[no-untyped-def]
    client, fleet, holder, path = admin
    path.write_text(CONFIG + "  - {name: z, url: 'http://127.0.0.1:9'}\n")
    resp = await client.post("/admin/reload", headers=AUTH)
    assert resp.status_code == 200 and resp.json()["reloads_ok"] == 1
    assert list(fleet.replicas) == ["a", "z"]
    path.write_text(CONFIG + "  - {name: z, url: 'nope'}\n")
    err = assert_openai_error(await client.post("/admin/reload", headers=AUTH), 400)
    assert err["code"] == "config_rejected" and "replicas.1.url" in err["message"]
    assert list(fleet.replicas) == ["a", "z"] and holder.reloads_rejected == 1
