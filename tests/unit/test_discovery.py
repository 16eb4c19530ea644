"""Discovery's pure parts: applying replica sets to a fleet (FleetSync), and pods and watch events to replicas."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvgate.router.fleet.config import DiscoveryConfig, ReplicaConfig
from kvgate.router.fleet.discovery.kubernetes import ApiError, Gone, KubernetesSource, WatchEvent, pod_target
from kvgate.router.fleet.discovery.sync import FleetSync
from kvgate.router.fleet.discovery.targets import Target
from kvgate.router.fleet.state import Fleet
from kvgate.router.settings.schema import KvgateConfig, parse_config
from kvgate.router.upstream.client import EngineClient
from tests.fleets import fleet_of
from tests.kube_api import POD, make_pod, set_ready
from tests.support import ManualClock


def target(name: str, port: int = 9000, ready: bool = True, instance: str = "") -> Target:
    return Target(ReplicaConfig(name=name, url=f"http://127.0.0.1:{port}"), ready, instance)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with EngineClient(8) as session:
        yield fleet_of(parse_config("replicas: [{name: static, url: 'http://127.0.0.1:9'}]"), session)


def state(fleet: Fleet) -> dict[str, bool]:
    """Each replica and whether it is draining."""
    return {name: r.draining for name, r in fleet.replicas.items()}


async def test_discovered_replicas_join_and_readiness_drains_and_undrains(fleet: Fleet) -> None:
    sync = FleetSync(fleet, drain_timeout_s=30)
    await sync.apply({"a": target("a"), "b": target("b", 9001, ready=False)})
    assert state(fleet) == {"static": False, "a": False, "b": True}
    await sync.apply({"a": target("a", ready=False), "b": target("b", 9001)})
    assert state(fleet) == {"static": False, "a": True, "b": False}


async def test_a_replica_that_left_is_drained_then_removed_when_its_requests_are_done(fleet: Fleet) -> None:
    clock = ManualClock(100.0)
    sync = FleetSync(fleet, drain_timeout_s=30, clock=clock)
    await sync.apply({"a": target("a"), "b": target("b", 9001)})
    ticket = fleet.dispatch("a", 100)
    await sync.apply({"b": target("b", 9001)})
    await sync.sweep()
    assert state(fleet) == {"static": False, "a": True, "b": False}  # a request still runs on it
    ticket.finish(ok=True)
    await sync.sweep()
    assert state(fleet) == {"static": False, "b": False}


async def test_a_drain_that_takes_too_long_ends_in_removal(fleet: Fleet) -> None:
    clock = ManualClock(100.0)
    sync = FleetSync(fleet, drain_timeout_s=30, clock=clock)
    await sync.apply({"a": target("a")})
    fleet.dispatch("a", 100)
    await sync.apply({})
    clock.now += 29
    await sync.sweep()
    assert "a" in fleet.replicas
    clock.now += 1
    await sync.sweep()
    assert "a" not in fleet.replicas


async def test_a_replica_back_before_its_removal_is_taken_back(fleet: Fleet) -> None:
    sync = FleetSync(fleet, drain_timeout_s=30)
    await sync.apply({"a": target("a")})
    fleet.dispatch("a", 100)
    await sync.apply({})
    assert state(fleet)["a"] is True
    await sync.apply({"a": target("a")})
    await sync.sweep()
    assert state(fleet)["a"] is False and not sync.leaving


async def test_a_name_that_is_another_engine_now_is_replaced(fleet: Fleet) -> None:
    sync = FleetSync(fleet, drain_timeout_s=30)
    await sync.apply({"a": target("a", instance="uid-1/0")})
    first = fleet.replicas["a"]
    await sync.apply({"a": target("a", instance="uid-1/1")})  # the engine container restarted
    second = fleet.replicas["a"]
    assert second is not first
    await sync.apply({"a": target("a", 9005, instance="uid-1/1")})  # a new address
    assert fleet.replicas["a"] is not second and fleet.replicas["a"].url == "http://127.0.0.1:9005"
    third = fleet.replicas["a"]
    await sync.apply({"a": target("a", 9005, instance="uid-1/1")})
    assert fleet.replicas["a"] is third  # the same engine is kept, with what the index knows of it


async def test_configured_and_operator_state_is_left_alone(fleet: Fleet) -> None:
    sync = FleetSync(fleet, drain_timeout_s=30)
    await sync.apply({"static": target("static", 9100)})
    assert fleet.replicas["static"].url == "http://127.0.0.1:9" and not sync.owned
    await sync.apply({"a": target("a")})
    fleet.drain("a")  # an operator drained it: readiness does not undo that
    await sync.apply({"a": target("a")})
    assert fleet.replicas["a"].draining
    await sync.apply({})
    assert "static" in fleet.replicas


def kube_config(**ports: object) -> DiscoveryConfig:
    data = {"discovery": {"kind": "kubernetes", "model": "m", "kubernetes": {"label_selector": "app=vllm",
            "api_server": "http://127.0.0.1:1", "namespace": "inference"},
            "ports": ports or {"http": "http", "kv_events": "kv-events", "kv_replay": "kv-replay"}}}
    return KvgateConfig.model_validate(data).discovery


def decoded(pod: dict) -> object:
    from kvgate.router.fleet.discovery.kubernetes import Pod

    return msgspec.json.decode(json.dumps(pod), type=Pod)


def test_a_recorded_pod_is_a_replica_named_after_it() -> None:
    t = pod_target(kube_config(), decoded(POD))
    assert t is not None and t.ready
    assert t.config.name == "vllm-0"
    assert (t.config.url, t.config.kv_events, t.config.kv_replay) == (
        "http://10.4.2.17:8000", "tcp://10.4.2.17:5557", "tcp://10.4.2.17:5558")
    assert t.config.labels == {"model": "m"}
    assert t.instance == "6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/0"
    numbered = pod_target(kube_config(http=9000, kv_events=None, kv_replay=None), decoded(POD))
    assert numbered is not None and numbered.config.url == "http://10.4.2.17:9000" and numbered.config.kv_events is None


def test_pods_without_a_replica() -> None:
    no_ip = copy.deepcopy(POD)
    no_ip["status"].pop("podIP")
    finished = copy.deepcopy(POD)
    finished["status"]["phase"] = "Succeeded"
    deleting = copy.deepcopy(POD)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-30T22:00:00Z"
    for pod in (no_ip, finished, deleting):
        assert pod_target(kube_config(), decoded(pod)) is None
    assert pod_target(kube_config(http="api"), decoded(POD)) is None  # no container port of that name
    unready = copy.deepcopy(POD)
    set_ready(unready, False)
    t = pod_target(kube_config(), decoded(unready))
    assert t is not None and not t.ready
    restarted = copy.deepcopy(POD)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 2
    t = pod_target(kube_config(), decoded(restarted))
    assert t is not None and t.instance.endswith("/2")


def event(kind: str, obj: dict) -> WatchEvent:
    return msgspec.json.decode(json.dumps({"type": kind, "object": obj}), type=WatchEvent)


def test_watch_events_update_the_pods_and_their_version() -> None:
    source = KubernetesSource(kube_config())
    pod = make_pod("vllm-1", "10.0.0.2", {"http": 8000}, True)
    pod["metadata"]["resourceVersion"] = "7"
    assert source._apply(event("ADDED", pod)) and set(source.targets()) == {"vllm-1"}
    assert not source._apply(event("BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                "metadata": {"resourceVersion": "9"}}))
    assert source.resource_version == "9"
    pod["metadata"]["resourceVersion"] = "10"
    assert source._apply(event("DELETED", pod)) and source.targets() == {}
    with pytest.raises(Gone):
        source._apply(event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"}))
    with pytest.raises(ApiError):
        source._apply(event("ERROR", {"kind": "Status", "code": 500, "reason": "InternalError"}))
    with pytest.raises(ApiError):
        source._apply(event("SURPRISE", pod))
    with pytest.raises(msgspec.DecodeError):
        source._apply(event("ADDED", {"metadata": {"name": 5}}))
