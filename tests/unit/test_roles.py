"""Replica roles (prefill/decode disaggregation): their config rules, discovered roles, and that no policy ever gives a
client's request to a prefill replica."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import PolicyConfig, TransferConfig
from kvgate.policies.cost_model import CostModel
from kvgate.policies.registry import POLICY_NAMES, create_policy
from kvgate.router.core.errors import ConfigError
from kvgate.router.fleet.config import ReplicaConfig
from kvgate.router.fleet.discovery.kubernetes import pod_target
from kvgate.router.settings.schema import KvgateConfig, parse_config
from tests.kube_api import POD
from tests.unit.test_discovery import decoded, kube_config


def replica(name: str, **kw: object) -> dict:
    return {"name": name, "url": f"http://127.0.0.1:9{len(name)}", **kw}


def test_role_defaults_to_both_and_bootstrap_port_belongs_to_sglang_prefill() -> None:
    assert ReplicaConfig.model_validate(replica("a")).role == "both"
    assert ReplicaConfig.model_validate(replica("p", role="prefill")).role == "prefill"
    sglang = ReplicaConfig.model_validate(replica("p", role="prefill", engine="sglang", bootstrap_port=8998))
    assert sglang.bootstrap_port == 8998
    with pytest.raises(ValueError, match="needs its bootstrap_port"):
        ReplicaConfig.model_validate(replica("p", role="prefill", engine="sglang"))
    with pytest.raises(ValueError, match="only meaningful for engine: sglang"):
        ReplicaConfig.model_validate(replica("p", role="prefill", bootstrap_port=8998))
    with pytest.raises(ValueError):
        ReplicaConfig.model_validate(replica("p", role="decoder"))


def test_a_fleet_of_only_prefill_replicas_is_refused() -> None:
    with pytest.raises(ConfigError, match="every replica is a prefill replica"):
        parse_config("replicas:\n  - {name: p0, url: 'http://127.0.0.1:9000', role: prefill}\n")
    config = parse_config(
        "replicas:\n  - {name: p0, url: 'http://127.0.0.1:9000', role: prefill}\n"
        "  - {name: d0, url: 'http://127.0.0.1:9001', role: decode}\n"
    )
    assert [r.role for r in config.replicas] == ["prefill", "decode"]


def test_pods_take_their_role_from_a_label_or_annotation() -> None:
    assert pod_target(kube_config(), decoded(POD)).config.role == "both"  # type: ignore[union-attr]
    labelled = copy.deepcopy(POD)
    labelled["metadata"]["labels"]["kvgate.io/role"] = "prefill"
    assert pod_target(kube_config(), decoded(labelled)).config.role == "prefill"  # type: ignore[union-attr]
    annotated = copy.deepcopy(POD)
    annotated["metadata"].setdefault("annotations", {})["kvgate.io/role"] = "decode"
    assert pod_target(kube_config(), decoded(annotated)).config.role == "decode"  # type: ignore[union-attr]
    nonsense = copy.deepcopy(POD)
    nonsense["metadata"]["labels"]["kvgate.io/role"] = "prefil"
    assert pod_target(kube_config(), decoded(nonsense)).config.role == "both"  # type: ignore[union-attr]


def test_dns_discovered_replicas_take_the_discovery_role() -> None:
    data = {"discovery": {"kind": "dns", "role": "decode", "dns": {"name": "vllm.local"}}}
    assert KvgateConfig.model_validate(data).discovery.role == "decode"
    data["discovery"].update(engine="sglang", role="prefill")
    with pytest.raises(ValueError, match="ports.bootstrap"):
        KvgateConfig.model_validate(data)


def views() -> list[ReplicaView]:
    """A prefill replica that is idle and holds the whole prompt, and two busy decode replicas."""
    return [
        ReplicaView(name="p0", healthy=True, can_source=True, match=PrefixMatch(gpu=4000), role="prefill"),
        ReplicaView(name="d0", healthy=True, match=PrefixMatch(), in_flight=5, role="decode"),
        ReplicaView(name="d1", healthy=False, match=PrefixMatch(), in_flight=9, role="decode"),
    ]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_policy_sends_a_client_request_to_a_prefill_replica(name: str) -> None:
    model = KvgateConfig().model_or_first("m")
    cost_model = CostModel.from_config(model.prefill, model.kv_bytes_per_token, PolicyConfig(),
                                       TransferConfig(connector="nixl"))
    policy = create_policy(name, PolicyConfig(), cost_model, random.Random(0))
    request = RouteRequest(request_id="r", model="m", prompt_tokens=4001, block_size=16)
    for _ in range(5):
        decision = policy.decide(request, views())
        assert decision.replica == "d0" and "p0" not in decision.ranked
    # every replica that takes requests is down: still never the prefill replica
    down = [v if v.role == "prefill" else dataclasses.replace(v, healthy=False) for v in views()]
    assert policy.decide(request, down).replica in ("d0", "d1")
