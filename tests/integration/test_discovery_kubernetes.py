"""Kubernetes discovery end to end: pods listed and watched from a loopback server speaking the API's wire format
(tests/kube_api.py says why it is not a real API server), `kvgate sim` replicas behind the pods, `kvgate serve`
routing the official openai client's requests the whole time. Pods are added, become ready and unready, are deleted,
and the watch expires (410) with changes it never delivered: the gateway lists again and catches up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import support
from tests.kube_api import KubeApi, make_pod, set_ready
from tests.support import Gateway, Sim, admin_replicas, routable_replicas, start_kvgate, start_sim
from tests.traffic import Traffic

pytestmark = pytest.mark.integration

INTERVAL_S = 0.5
DEADLINE_S = 5.0
ADMIN_TOKEN = "admin-s3cret"
TOKEN = "sa-token-for-tests"
SELECTOR = "app=vllm"


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi("inference", TOKEN).start()
    try:
        yield server
    finally:
        server.stop()


def pod(sim: Sim, i: int, ready: bool = True, **labels: str) -> dict:
    ports = {"http": sim.http_port + i, "kv-events": sim.zmq_port + 2 * i, "kv-replay": sim.zmq_port + 2 * i + 1}
    return make_pod(f"vllm-{i}", "127.0.0.1", ports, ready, {"app": "vllm", **labels})


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> float:
    """Poll until true; the time it first was."""
    support.wait_until(predicate, what, timeout)
    return time.monotonic()


def replicas(gw: Gateway) -> dict[str, dict[str, Any]]:
    return admin_replicas(gw, ADMIN_TOKEN)


def routable(gw: Gateway) -> set[str]:
    return routable_replicas(gw, ADMIN_TOKEN)


def gateway_config(sim: Sim, api: KubeApi, tmp_path: Path) -> Path:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    config = yaml.safe_load(sim.config_path.read_text())
    config["replicas"] = []
    config["server"] = {**config.get("server", {}), "admin_token": ADMIN_TOKEN}
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config["policy"] = {**config.get("policy", {}), "name": "round_robin"}
    config["discovery"] = {
        "kind": "kubernetes", "interval_s": INTERVAL_S, "drain_timeout_s": 10,
        "ports": {"http": "http", "kv_events": "kv-events", "kv_replay": "kv-replay"},
        "kubernetes": {"api_server": api.url, "namespace": "inference", "label_selector": SELECTOR,
                       "token_file": str(token), "watch_timeout_s": 3},
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pods_added_ready_unready_deleted_and_relisted(tmp_path: Path, api: KubeApi) -> None:
    sim = start_sim(tmp_path, 3)
    gw: Gateway | None = None
    try:
        pods = {i: pod(sim, i) for i in range(3)}
        api.put(pods[0])
        api.put(make_pod("web-0", "127.0.0.1", {"http": sim.http_port + 2}, True, {"app": "web"}))
        gw = start_kvgate(tmp_path, gateway_config(sim, api, tmp_path))
        wait_until(lambda: routable(gw) == {"vllm-0"}, "the listed pod routable")
        with Traffic(gw.url) as traffic:
            traffic.wait_for_answers(10, after=time.monotonic())

            set_ready(pods[1], False)
            api.put(pods[1])  # created, not ready yet: known (its events are followed), no requests
            wait_until(lambda: "vllm-1" in replicas(gw), "an unready pod added")
            assert replicas(gw)["vllm-1"]["draining"] and routable(gw) == {"vllm-0"}

            ready_at = time.monotonic()
            set_ready(pods[1], True)
            api.put(pods[1])
            wait_until(lambda: traffic.first_answer_from("vllm-1", ready_at) is not None, "a ready pod routed to")
            answered = traffic.first_answer_from("vllm-1", ready_at)
            assert answered is not None

            unready_at = time.monotonic()
            set_ready(pods[0], False)
            api.put(pods[0])
            drained_at = wait_until(lambda: "vllm-0" not in routable(gw), "an unready pod drained")
            traffic.wait_for_answers(10, after=drained_at)
            last_on_0 = traffic.last_start_on("vllm-0")
            assert last_on_0 is not None and last_on_0 < drained_at
            assert "vllm-0" in replicas(gw)  # unready is not gone: still subscribed, back when ready

            set_ready(pods[0], True)
            api.put(pods[0])
            wait_until(lambda: routable(gw) == {"vllm-0", "vllm-1"}, "a pod ready again undrained")

            pods[1]["metadata"]["deletionTimestamp"] = "2026-11-30T22:00:00Z"
            api.put(pods[1])  # terminating: drained, removed when its requests are done
            api.delete("vllm-1")
            wait_until(lambda: "vllm-1" not in replicas(gw), "a deleted pod removed")

            lists = api.lists
            api.put_unseen(pods[2])  # a pod created while the watch could not deliver it
            api.expire()
            wait_until(lambda: api.lists > lists, "a re-list after 410 Gone")
            wait_until(lambda: routable(gw) == {"vllm-0", "vllm-2"}, "the re-listed pods routable")
            traffic.wait_for_answers(10, after=time.monotonic())

        assert traffic.errors() == [], traffic.errors()[:5]
        assert "web-0" not in replicas(gw)
        assert api.unauthorized == 0 and api.selectors == {SELECTOR}
        print(f"\nKubernetes discovery: ready -> first answer {answered - ready_at:.3f}s, unready -> drained "
              f"{drained_at - unready_at:.3f}s; {len(traffic.outcomes)} requests, 0 errors, {api.watches} watches")
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()
