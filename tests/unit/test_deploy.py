"""The Kubernetes manifests are valid for the API server and say what kvgate needs.

Validation is against the Kubernetes OpenAPI schemas as JSON schemas (kubernetes-validate, the same schema set
kubeconform uses; strict: unknown fields fail), for the oldest and newest versions targeted. ``kubectl apply
--dry-run=client`` cannot do this here: it downloads the schemas from an API server, and none runs on these machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvgate.router.settings.schema import parse_config

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes.yaml"
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
"""1.30: the oldest release with the preStop sleep action on by default."""


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_is_valid_for_the_api_server(version: str) -> None:
    for doc in documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {e}") from e


def test_the_policy_file_discovers_the_engines_the_manifest_runs() -> None:
    (configmap,) = by_kind("ConfigMap")
    config = parse_config(configmap["data"]["policy.yaml"], "ConfigMap kvgate-policy")
    assert config.replicas == [] and config.discovery.kind == "kubernetes"
    (engines,) = by_kind("StatefulSet")
    pod = engines["spec"]["template"]
    selector = dict(term.split("=") for term in config.discovery.kubernetes.label_selector.split(","))
    assert selector.items() <= pod["metadata"]["labels"].items()
    port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    ports = config.discovery.ports
    assert {ports.http, ports.kv_events, ports.kv_replay} <= port_names


def test_the_gateway_may_watch_pods_and_is_kept_available() -> None:
    (deployment,) = by_kind("Deployment")
    gateway = deployment["spec"]["template"]["spec"]
    (role,) = by_kind("Role")
    (binding,) = by_kind("RoleBinding")
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": gateway["serviceAccountName"]} in binding["subjects"]
    assert gateway["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert any(p["spec"]["selector"]["matchLabels"] == labels for p in by_kind("PodDisruptionBudget"))
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "cpu" in gateway["containers"][0]["resources"]["requests"]  # utilization is relative to the request


def test_a_starting_gateway_warms_up_from_the_ready_gateways() -> None:
    (configmap,) = by_kind("ConfigMap")
    config = parse_config(configmap["data"]["policy.yaml"], "ConfigMap kvgate-policy")
    assert config.peers.enabled and config.peers.warm_start_timeout_s > 0
    (deployment,) = by_kind("Deployment")
    gateway = deployment["spec"]["template"]
    peers = next(s for s in by_kind("Service") if config.peers.dns.name.startswith(s["metadata"]["name"] + "."))
    assert peers["spec"]["clusterIP"] == "None"  # headless: one record per gateway pod
    assert not peers["spec"].get("publishNotReadyAddresses")  # only warm gateways are asked
    assert peers["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    container = gateway["spec"]["containers"][0]
    port = peers["spec"]["ports"][0]
    assert port["port"] == config.peers.port
    assert any(p["name"] == port["targetPort"] and p["containerPort"] == config.server.port for p in container["ports"])
    assert "KVGATE_PEER_TOKEN" in {e["name"] for e in container["env"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_the_gateways_share_hints_with_every_peer_the_headless_service_lists() -> None:
    (configmap,) = by_kind("ConfigMap")
    config = parse_config(configmap["data"]["policy.yaml"], "ConfigMap kvgate-policy")
    hints = config.peers.hints
    assert hints.bind is not None and hints.port is not None and config.peers.dns.name and hints.work_ttl_s > 0
    (deployment,) = by_kind("Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    bound = int(hints.bind.rsplit(":", 1)[1])
    assert bound == hints.port
    assert any(p["containerPort"] == bound for p in container["ports"])
    assert "KVGATE_PEER_TOKEN" in {e["name"] for e in container["env"]}  # the Secret's token keys the hints
    (ingress,) = [p for p in by_kind("NetworkPolicy") if p["metadata"]["name"] == "kvgate-ingress"]
    allowed = [rule for rule in ingress["spec"]["ingress"] if any(p["port"] == bound for p in rule["ports"])]
    assert allowed and all(rule.get("from") == [{"podSelector": {"matchLabels": {"app": "kvgate"}}}]
                           for rule in allowed)  # from the gateways only
