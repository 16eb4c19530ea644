"""``GET /admin/state`` on a gateway built in-process and filled far past every cap: many replicas with many models
and event streams, many peers, a long blindness list. The body stays within a fixed bound and says how much it left
out, and holds no block key."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest

from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import Tier
from kvgate.loadgen.sim.wire import BlockStored, KVEventBatch
from kvgate.router.app.admin import (
    MAX_STATE_MODELS, MAX_STATE_PEERS, MAX_STATE_QUEUES, MAX_STATE_REPLICAS, MAX_STATE_STREAMS, Admin,
    admission_state, state_dump,
)
from kvgate.router.app.routes import Routes
from kvgate.router.fleet.blindness import MAX_NAMED_REPLICAS, Observation
from kvgate.router.gateway import Gateway
from kvgate.router.peers.hints import MAX_HEARD_SENDERS, Work
from kvgate.router.settings.holder import ConfigHolder
from tests.served import served

REPLICAS = 600
MODELS_PER_REPLICA = 50
STREAMS = 40
PEERS = 300
STATE_BOUND_BYTES = MAX_STATE_REPLICAS * 2048 + 64 * 1024
"""About 2 KiB per replica listed, and room for the totals, the peers and admission."""
TOKEN = "admin-s3cret"
BS = 16


def policy() -> str:
    replicas = "\n".join(
        f"  - {{name: r{i:03d}, url: 'http://127.0.0.1:{10000 + i}', labels: {{zone: z{i % 3}, rack: k{i % 7}}}}}"
        for i in range(REPLICAS))
    urls = ", ".join(f"'http://10.0.{i // 250}.{i % 250}:8000'" for i in range(PEERS))
    connect = ", ".join(f"'tcp://10.0.{i // 250}.{i % 250}:5590'" for i in range(PEERS))
    return (f"server: {{admin_token: {TOKEN}, peer_token: peer-s3cret}}\n"
            f"peers: {{urls: [{urls}], hints: {{connect: [{connect}]}}}}\n"
            f"replicas:\n{replicas}\n")


@pytest.fixture
async def filled(tmp_path: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, list[int]]]:
    path = tmp_path / "kvgate.yaml"
    path.write_text(policy())
    gateway = Gateway(ConfigHolder(path))
    gateway.build()
    keys = block_keys(namespace_key("m"), list(range(BS * 64)), BS)
    try:
        for i, replica in enumerate(gateway.fleet.replicas.values()):
            replica.served_models = [{"id": f"adapter-{j}"} for j in range(MODELS_PER_REPLICA)]
            gateway.ingestor.add_replica(replica.name, model="m")
            gateway.index.store(replica.name, keys, Tier.GPU if i % 2 else Tier.CPU,
                                gateway.ingestor.generation(replica.name))
        tokens = list(range(BS))
        for rank in range(STREAMS):
            stored = BlockStored([rank + 1], None, tokens, BS, lora_id=None, medium="GPU", lora_name=None)
            frame = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=rank))
            gateway.ingestor.apply("r000", 5, frame, rank)
        exchange = gateway.hints.exchange
        for i in range(PEERS):
            work = Work(time.time(), f"gateway-{i:03d}", [("r000", 100, 1, 2.0)])
            assert exchange.apply(msgspec.msgpack.encode(work))
        names = list(gateway.fleet.replicas)
        for t in range(30):
            gateway.fleet.blindness.update(float(t), Observation(30.0, 10.0, 10.0), names)
        routes = Routes()
        Admin(gateway.fleet, gateway.holder, gateway.parity, lambda: state_dump(gateway)).add_routes(routes)
        async with served(routes) as url, httpx.AsyncClient(base_url=url) as client:
            yield gateway, client, keys
    finally:
        await gateway.stop()


async def test_the_dump_is_admin_only(filled: tuple[Gateway, httpx.AsyncClient, list[int]]) -> None:
    _, client, _ = filled
    assert (await client.get("/admin/state")).status_code == 401
    assert (await client.get("/admin/state", headers={"Authorization": "Bearer wrong"})).status_code == 403


async def test_the_dump_stays_bounded_past_every_cap(filled: tuple[Gateway, httpx.AsyncClient, list[int]]) -> None:
    _, client, keys = filled
    resp = await client.get("/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200
    body = resp.content
    assert len(body) < STATE_BOUND_BYTES, len(body)
    doc = json.loads(body)
    assert doc["replicas_total"] == REPLICAS and doc["replicas_truncated"] == REPLICAS - MAX_STATE_REPLICAS
    assert len(doc["replicas"]) == MAX_STATE_REPLICAS
    first = doc["replicas"][0]
    assert first["models_total"] == MODELS_PER_REPLICA and len(first["models"]) == MAX_STATE_MODELS
    assert first["events"]["streams_total"] == STREAMS and len(first["events"]["streams"]) == MAX_STATE_STREAMS
    assert first["index"]["cpu_blocks"] == len(keys) and doc["replicas"][1]["index"]["gpu_blocks"] == len(keys)
    assert first["peers"]["prefilling"] == PEERS and first["cost_view"]["in_flight_prefilling"] == PEERS
    peers = doc["peers"]
    assert peers["heard_total"] == MAX_HEARD_SENDERS and len(peers["heard"]) == MAX_STATE_PEERS
    assert peers["reporting_total"] == PEERS and peers["heard"][0]["work_report_age_s"] is not None
    assert peers["warm_start"]["urls_total"] == PEERS and len(peers["warm_start"]["urls"]) == MAX_STATE_PEERS
    blind = doc["blind"]
    assert blind["blind"] is True and blind["replicas_total"] == REPLICAS
    assert len(blind["replicas"]) == MAX_NAMED_REPLICAS
    text = body.decode()
    assert not any(str(key) in text for key in keys)  # counts only: no block key
    assert doc["admission"]["waiting"] == 0


def test_admission_lists_the_largest_queues_only() -> None:
    """Requests name their own band, so bands are as many as clients choose: every list is capped."""
    depth = {(band, None if band % 2 else f"tenant-{band % 80}"): band + 1 for band in range(200)}
    admission = SimpleNamespace(depth=lambda: iter(depth.items()),
                                depth_by_model=lambda: {f"model-{i}": i + 1 for i in range(100)})
    state: dict[str, Any] = admission_state(SimpleNamespace(admission=admission))  # type: ignore[arg-type]
    assert state["waiting"] == sum(depth.values())
    assert state["bands_total"] == 200 and len(state["by_band"]) == MAX_STATE_QUEUES and "199" in state["by_band"]
    assert state["models_total"] == 100 and len(state["by_model"]) == MAX_STATE_QUEUES
    assert state["by_model"]["model-99"] == 100
    assert state["tenants_total"] == 41 and len(state["by_tenant"]) == MAX_STATE_QUEUES
    assert state["by_tenant"]["none"] == sum(n for (band, _), n in depth.items() if band % 2)
