"""Engine replicas from the Kubernetes API: the pods matching a label selector, listed and then watched.

``GET /api/v1/namespaces/NS/pods?labelSelector=...`` gives the pods and a ``resourceVersion``; a watch from there
(``?watch=1&resourceVersion=...``) streams one JSON event per line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR). A
watch that ends is resumed from the last version seen; ``410 Gone`` (the version is too old) starts over with a list.
Any other failure, malformed event included, waits ``interval_s`` and lists again; the last published set stays in
force until then.

A pod is a replica when it has an IP and the engine's HTTP port (by number, or by container port name), and is neither
finished nor being deleted (a deleted pod leaves: drained, then removed when its requests are done). Its Ready
condition says whether it takes new requests. It is named after the pod; its uid and container restarts tell the
fleet sync when the name stands for a new engine process.

The token is re-read from the service account's file before every request, since the kubelet rotates it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path
from urllib.parse import quote

import aiohttp
import msgspec

from kvgate.router.fleet.config import DiscoveryConfig, Role
from kvgate.router.fleet.discovery.targets import Publish, Target, replica_config

log = logging.getLogger(__name__)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""A watch line longer than this is not a pod event: the stream is dropped and the pods listed again."""
CONNECT_TIMEOUT_S = 5.0


class ContainerPort(msgspec.Struct):
    containerPort: int
    name: str = ""


class Container(msgspec.Struct):
    name: str = ""
    ports: list[ContainerPort] = []


class PodSpec(msgspec.Struct):
    containers: list[Container] = []


class Condition(msgspec.Struct):
    type: str
    status: str


class ContainerStatus(msgspec.Struct):
    name: str = ""
    restartCount: int = 0


class PodStatus(msgspec.Struct):
    phase: str = ""
    podIP: str = ""
    conditions: list[Condition] = []
    containerStatuses: list[ContainerStatus] = []


class ObjectMeta(msgspec.Struct):
    name: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    uid: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None


class Pod(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)


class ListMeta(msgspec.Struct):
    resourceVersion: str = ""


class PodList(msgspec.Struct):
    items: list[Pod] = []
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)


class Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class ApiError(Exception):
    """The API server refused or sent something that is not a pod list or watch event."""


_decode_list = msgspec.json.Decoder(PodList).decode
_decode_event = msgspec.json.Decoder(WatchEvent).decode
_decode_pod = msgspec.json.Decoder(Pod).decode
_decode_status = msgspec.json.Decoder(Status).decode


class KubernetesSource:
    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        settings = config.kubernetes
        self.api_server = (settings.api_server or _in_cluster_api_server()).rstrip("/")
        self.namespace = settings.namespace or Path(NAMESPACE_FILE).read_text().strip()
        self.path = f"/api/v1/namespaces/{quote(self.namespace, safe='')}/pods"
        self.pods: dict[str, Pod] = {}
        self.resource_version = ""

    async def run(self, publish: Publish) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.config.kubernetes.watch_timeout_s + 30.0
        )
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=self._ssl())) as session:
            while True:
                try:
                    await self._list(session, publish)
                    while True:
                        await self._watch(session, publish)
                except Gone:
                    log.info("discovery: pod watch expired (410 Gone): listing again")
                except (aiohttp.ClientError, asyncio.TimeoutError, ApiError, msgspec.DecodeError, ValueError) as e:
                    log.warning("discovery: pod list/watch failed, retrying in %.1fs: %s", self.config.interval_s, e)
                    await asyncio.sleep(self.config.interval_s)

    def targets(self) -> dict[str, Target]:
        """The replicas the pods known now stand for."""
        out: dict[str, Target] = {}
        for pod in self.pods.values():
            target = pod_target(self.config, pod)
            if target is not None:
                out[target.config.name] = target
        return out

    async def _list(self, session: aiohttp.ClientSession, publish: Publish) -> None:
        params = {"labelSelector": self.config.kubernetes.label_selector}
        async with session.get(self.api_server + self.path, params=params, headers=self._headers()) as resp:
            if resp.status != 200:
                raise ApiError(f"list pods: HTTP {resp.status}: {(await resp.text())[:200]}")
            pods = _decode_list(await resp.read())
        self.pods = {p.metadata.name: p for p in pods.items if p.metadata.name}
        self.resource_version = pods.metadata.resourceVersion
        await publish(self.targets())

    async def _watch(self, session: aiohttp.ClientSession, publish: Publish) -> None:
        """One watch from the last resourceVersion, until the server ends it."""
        params = {
            "labelSelector": self.config.kubernetes.label_selector,
            "watch": "1",
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self.config.kubernetes.watch_timeout_s)),
        }
        async with session.get(self.api_server + self.path, params=params, headers=self._headers()) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise ApiError(f"watch pods: HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in _lines(resp.content):
                if self._apply(_decode_event(line)):
                    await publish(self.targets())

    def _apply(self, event: WatchEvent) -> bool:
        """Apply one watch event; True when the pods changed."""
        if event.type == "ERROR":
            status = _decode_status(event.object)
            if status.code == 410:
                raise Gone()
            raise ApiError(f"watch error {status.code} {status.reason}: {status.message[:200]}")
        pod = _decode_pod(event.object)
        if pod.metadata.resourceVersion:
            self.resource_version = pod.metadata.resourceVersion
        if event.type == "BOOKMARK":
            return False
        if not pod.metadata.name:
            raise ApiError(f"{event.type} event for a pod without a name")
        if event.type in ("ADDED", "MODIFIED"):
            self.pods[pod.metadata.name] = pod
        elif event.type == "DELETED":
            self.pods.pop(pod.metadata.name, None)
        else:
            raise ApiError(f"unknown watch event type {event.type[:40]!r}")
        return True

    def _headers(self) -> dict[str, str]:
        try:
            token = Path(self.config.kubernetes.token_file).read_text().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api_server.startswith("https://"):
            return False
        ca_file = self.config.kubernetes.ca_file
        return ssl.create_default_context(cafile=ca_file if os.path.exists(ca_file) else None)


def pod_target(config: DiscoveryConfig, pod: Pod) -> Target | None:
    """The replica a pod stands for, or None when it has none (no IP yet, finished, being deleted, no HTTP port)."""
    meta, status = pod.metadata, pod.status
    if meta.deletionTimestamp or status.phase in ("Succeeded", "Failed") or not status.podIP or not meta.name:
        return None
    named = {p.name: p.containerPort for c in pod.spec.containers for p in c.ports if p.name}
    ports = config.ports

    def port(ref: int | str | None) -> int | None:
        return ref if isinstance(ref, int) or ref is None else named.get(ref)

    http = port(ports.http)
    if http is None:
        return None
    role = pod_role(config, meta)
    bootstrap = port(ports.bootstrap)
    if config.engine == "sglang" and role == "prefill" and bootstrap is None:
        return None  # an SGLang prefill server is unusable without its bootstrap port
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions)
    restarts = sum(c.restartCount for c in status.containerStatuses)
    return Target(
        replica_config(
            config, meta.name, status.podIP, http, port(ports.kv_events), port(ports.kv_replay), role, bootstrap
        ),
        ready=ready,
        instance=f"{meta.uid}/{restarts}",
    )


def pod_role(config: DiscoveryConfig, meta: ObjectMeta) -> Role:
    """The pod's role: its ``kubernetes.role_label`` label, else that annotation, else ``discovery.role`` (also
    when the value is not a role)."""
    key = config.kubernetes.role_label
    value = meta.labels.get(key, meta.annotations.get(key))
    return value if value in ("prefill", "decode", "both") else config.role  # type: ignore[return-value]


async def _lines(stream: aiohttp.StreamReader):
    """The stream's non-empty lines; :class:`ApiError` for a line over :data:`MAX_EVENT_BYTES`."""
    buffer = bytearray()
    async for chunk in stream.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end]).strip()
            del buffer[:end + 1]
            if line:
                yield line
        if len(buffer) > MAX_EVENT_BYTES:
            raise ApiError(f"watch event over {MAX_EVENT_BYTES} bytes")
    if buffer.strip():
        yield bytes(buffer).strip()


def _in_cluster_api_server() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("discovery.kubernetes.api_server is not set and KUBERNETES_SERVICE_HOST is not either")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
