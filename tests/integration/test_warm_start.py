"""Warm start end to end: a `kvgate serve` started next to a running one takes its prefix index (real processes, a
real `kvgate sim` fleet whose replay buffers hold a single batch, real HTTP and ZMQ, the official openai client).

Gateway A is warmed with traffic; gateway B, started with A as its peer, credits the same holdings at once and its
first requests hit, where a gateway started without a peer knows nothing (the replay buffers cannot teach it). Then
the snapshots B must not use: one taken before an engine restarted, malformed ones, other engines' and models', and
peers that cannot be reached or never answer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from kvgate.loadgen.bench import free_port_block
from kvgate.router.peers.snapshot import Snapshot
from tests.integration.test_gateway import MODEL, gateway_config, sim_fault
from tests.integration.test_index_e2e import full_blocks, prompt_of, send
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

PEER_TOKEN = "peer-token-for-tests"
ADMIN_TOKEN = "admin-token-for-tests"
SERVER = {"peer_token": PEER_TOKEN, "admin_token": ADMIN_TOKEN}
PROMPTS = 6
PATIENCE_S = 30.0
"""How long events may take to show in an index on a loaded machine."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warm-start")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0", "--block-size", "16", "--replay-buffer-steps", "1")
    yield s
    s.stop()


def start_gateway(sim: Sim, workdir: Path, name: str, **sections: dict) -> Gateway:
    return start_kvgate(workdir, gateway_config(sim, workdir, name, server=SERVER, **sections))


def wait_ready(gw: Gateway, replicas: int, timeout: float = 60.0) -> float:
    """Seconds until /ready answers 200 with all ``replicas`` routable: it is ready once one passes its health checks,
    and a prompt sent before the others do could only go to that one."""
    started = time.monotonic()

    def all_routable() -> bool:
        r = httpx.get(gw.url + "/ready", timeout=5)
        return r.status_code == 200 and len(r.json().get("routable", [])) == replicas

    wait_until(all_routable, timeout=timeout)
    return time.monotonic() - started


def cached(gw: Gateway, prompt: str) -> dict[str, int]:
    """GPU tokens each replica is credited with for ``prompt`` (confirmed holdings, not predictions)."""
    r = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=5)
    r.raise_for_status()
    return {row["name"]: row["cached_tokens"]["gpu"] for row in r.json()["replicas"]}


@pytest.fixture(scope="module")
def warm_a(sim: Sim, workdir: Path) -> Iterator[tuple[Gateway, list[str]]]:
    """Gateway A, with prompts sent through it and then enough other traffic that the engines' one-batch replay
    buffers hold none of the prompts' batches."""
    a = start_gateway(sim, workdir, "a.yaml")
    try:
        wait_ready(a, sim.replicas)
        for i in range(sim.replicas):  # A's subscriptions deliver (a PUB drops what it sends before a SUB joins)
            probe = prompt_of(f"a-joined-{i}", words=8)
            wait_until(lambda: send(sim, i, probe) >= 0 and cached(a, probe)[f"sim-{i}"] > 0, timeout=PATIENCE_S,
                       interval=0.1)
        client = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        prompts = [prompt_of(f"warm-{i}") for i in range(PROMPTS)]
        for prompt in prompts:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        for prompt in prompts:
            wait_until(lambda: max(cached(a, prompt).values()) > 0, timeout=PATIENCE_S)
        for i in range(sim.replicas):
            send(sim, i, prompt_of(f"later-{i}", words=4))
        yield a, prompts
    finally:
        a.stop()


def test_a_gateway_started_next_to_a_warm_one_is_warm_at_once(
    sim: Sim, workdir: Path, warm_a: tuple[Gateway, list[str]]
) -> None:
    a, prompts = warm_a
    cold = start_gateway(sim, workdir, "cold.yaml")
    b = start_gateway(sim, workdir, "b.yaml", peers={"urls": [a.url], "warm_start_timeout_s": 10})
    try:
        wait_ready(cold, sim.replicas)
        wait_ready(b, sim.replicas)
        for prompt in prompts:
            expected = cached(a, prompt)
            assert max(expected.values()) > 0
            assert cached(b, prompt) == expected
            assert max(cached(cold, prompt).values()) == 0  # the replay buffers could not teach it
        client = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        for prompt in prompts:
            holders = cached(a, prompt)
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
            usage = raw.parse().usage
            assert holders[raw.headers["x-kvgate-replica"]] == max(holders.values())
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == max(holders.values())
        # the live streams continue from the snapshot: new blocks are learned without any purge
        fresh = prompt_of("after-warm-start")
        send(sim, 1, fresh)
        wait_until(lambda: cached(b, fresh)["sim-1"] > 0, timeout=PATIENCE_S)
        assert cached(b, prompts[0]) == cached(a, prompts[0])
    finally:
        b.stop()
        cold.stop()


class FixedPeer:
    """A loopback HTTP server that answers every request with the same status and body: a peer that lies."""

    def __init__(self, body: bytes, status: int = 200) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(status)
                self.send_header("content-type", "application/vnd.kvgate.snapshot+msgpack")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def snapshot_of(gw: Gateway) -> bytes:
    r = httpx.get(gw.url + "/kvgate/v1/peer/snapshot", headers={"authorization": f"Bearer {PEER_TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.content


def start_with_peer(sim: Sim, workdir: Path, name: str, body: bytes) -> Gateway:
    peer = FixedPeer(body)
    try:
        gw = start_gateway(sim, workdir, name, peers={"urls": [peer.url], "warm_start_timeout_s": 10})
        wait_ready(gw, sim.replicas)
    finally:
        peer.stop()
    return gw


def test_the_snapshot_is_for_peers_only(warm_a: tuple[Gateway, list[str]]) -> None:
    a, _ = warm_a
    url = a.url + "/kvgate/v1/peer/snapshot"
    assert httpx.get(url, timeout=5).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer not-a-peer"}, timeout=5).status_code == 403
    assert httpx.get(url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).status_code == 200
    assert len(snapshot_of(a)) > 0


def test_a_tenant_key_never_opens_the_snapshot(sim: Sim, workdir: Path) -> None:
    tenants = {"api_keys": {"tenant-key": "alpha"}, "salt_secret": "warm-start-salt-secret"}
    gw = start_kvgate(workdir, gateway_config(sim, workdir, "tenants.yaml", tenants=tenants,
                                              server={"peer_token": PEER_TOKEN}))
    try:
        r = httpx.get(gw.url + "/kvgate/v1/peer/snapshot", headers={"authorization": "Bearer tenant-key"}, timeout=5)
        assert r.status_code == 403
    finally:
        gw.stop()


def test_a_replica_whose_engine_restarted_since_the_snapshot_is_left_out(
    sim: Sim, workdir: Path, warm_a: tuple[Gateway, list[str]]
) -> None:
    a, _ = warm_a
    prompts = {i: prompt_of(f"before-restart-{i}") for i in range(sim.replicas)}
    for i, prompt in prompts.items():
        send(sim, i, prompt)
        wait_until(lambda: cached(a, prompt)[f"sim-{i}"] > 0, timeout=PATIENCE_S)
    stale = snapshot_of(a)
    sim_fault(sim, 0, "restart", 0)  # a new engine process: nothing it held survives
    b = start_with_peer(sim, workdir, "b-stale.yaml", stale)
    try:
        wait_until(lambda: "its engine restarted since" in b.process.output())  # info lines come in batches
        assert cached(b, prompts[0])["sim-0"] == 0
        assert cached(b, prompts[1])["sim-1"] == full_blocks(
            httpx.post(b.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompts[1]}, timeout=5).json())
    finally:
        b.stop()


def _altered(raw: bytes, **changes: str) -> bytes:
    snapshot = msgspec.msgpack.decode(raw, type=Snapshot)
    entries = []
    for entry in snapshot.replicas:
        state = msgspec.structs.replace(entry.state, model=changes.get("model", entry.state.model))
        entries.append(msgspec.structs.replace(entry, state=state, kv_events=changes.get("kv_events", entry.kv_events)))
    return msgspec.msgpack.encode(msgspec.structs.replace(snapshot, replicas=entries))


@pytest.mark.parametrize("kind", ["garbage", "truncated", "other model", "other engines"])
def test_a_bad_snapshot_is_rejected_whole_and_the_gateway_starts_cold(
    sim: Sim, workdir: Path, warm_a: tuple[Gateway, list[str]], kind: str
) -> None:
    a, prompts = warm_a
    raw = snapshot_of(a)
    body = {
        "garbage": b"\xc1not msgpack",
        "truncated": raw[: len(raw) // 2],
        "other model": _altered(raw, model="another-model"),
        "other engines": _altered(raw, kv_events="tcp://127.0.0.1:1"),
    }[kind]
    b = start_with_peer(sim, workdir, f"b-{kind.replace(' ', '-')}.yaml", body)
    try:
        for prompt in prompts:
            assert max(cached(b, prompt).values()) == 0
        wait_until(lambda: "rejected" in b.process.output())
    finally:
        b.stop()


def test_without_a_reachable_peer_the_gateway_starts_cold_within_the_timeout(sim: Sim, workdir: Path) -> None:
    refused = f"http://127.0.0.1:{free_port_block(1)}"
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        started = time.monotonic()
        quick = start_gateway(sim, workdir, "b-refused.yaml", peers={"urls": [refused], "warm_start_timeout_s": 60})
        try:
            wait_ready(quick, sim.replicas)
            assert time.monotonic() - started < 30  # nothing to wait for: cold at once, long before the timeout
        finally:
            quick.stop()
        hanging = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        slow = start_gateway(sim, workdir, "b-silent.yaml", peers={"urls": [hanging], "warm_start_timeout_s": 3})
        try:
            wait_ready(slow, sim.replicas)
            assert 3 <= time.monotonic() - started < 30  # it waited for the silent peer, then went on cold
        finally:
            slow.stop()
    finally:
        silent.close()
