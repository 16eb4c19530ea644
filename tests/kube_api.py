"""A loopback HTTP server that answers the Kubernetes API's pod list and watch as the API server does.

No Kubernetes API server can run on this machine (none of the allowed registries ships kube-apiserver), so this one
speaks its wire format for the two requests pod discovery makes: ``GET /api/v1/namespaces/NS/pods?labelSelector=``
(a ``PodList`` with its ``resourceVersion``) and the same with ``watch=1&resourceVersion=N`` (a chunked stream of
``{"type": ..., "object": ...}`` lines, ended after ``timeoutSeconds``; a version older than the history kept is an
``ERROR`` event with a 410 ``Expired`` Status, as the API server sends). Pods are the recorded object in
``tests/data/kubernetes/pod.json`` with their name, uid, address, ports and readiness changed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

POD = json.loads((Path(__file__).parent / "data" / "kubernetes" / "pod.json").read_text())


def make_pod(name: str, ip: str, ports: dict[str, int], ready: bool, labels: dict[str, str] | None = None) -> dict:
    """The recorded pod as another pod of the StatefulSet: ``ports`` by name, Ready or not."""
    pod = copy.deepcopy(POD)
    pod["metadata"]["name"] = pod["spec"]["hostname"] = name
    pod["metadata"]["uid"] = str(uuid.uuid4())
    pod["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] = name
    pod["metadata"]["labels"].update(labels or {})
    pod["spec"]["containers"][0]["ports"] = [
        {"containerPort": port, "name": port_name, "protocol": "TCP"} for port_name, port in ports.items()
    ]
    pod["status"]["podIP"] = ip
    pod["status"]["podIPs"] = [{"ip": ip}]
    set_ready(pod, ready)
    return pod


def set_ready(pod: dict, ready: bool) -> None:
    for condition in pod["status"]["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    pod["status"]["containerStatuses"][0]["ready"] = ready


class KubeApi:
    """Pods of one namespace; tests change them from their own thread and every watcher sees the events."""

    def __init__(self, namespace: str, token: str) -> None:
        self.namespace = namespace
        self.token = token
        self.pods: dict[str, dict] = {}
        self.version = 1000
        self.history: list[tuple[int, dict]] = []
        self.oldest_watchable = self.version
        self.lists = 0
        self.watches = 0
        self.unauthorized = 0
        self.selectors: set[str] = set()
        self._watchers: set[asyncio.Queue[dict | None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "KubeApi":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    # changes, from the test's thread

    def put(self, pod: dict) -> None:
        """Create or update a pod (ADDED or MODIFIED)."""
        self._call(self._put, copy.deepcopy(pod), True)

    def put_unseen(self, pod: dict) -> None:
        """A change whose event watchers cannot get any more: compacted away, as while a watch was down."""
        self._call(self._put, copy.deepcopy(pod), False)

    def delete(self, name: str) -> None:
        self._call(self._delete, name)

    def expire(self) -> None:
        """Compact the history: open watches end with ``410 Expired``, and so does any watch from an older version."""
        self._call(self._expire)

    # the server

    def _call(self, fn: Any, *args: Any) -> None:
        async def run() -> None:
            fn(*args)

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _next_version(self) -> str:
        self.version += 1
        return str(self.version)

    def _emit(self, kind: str, pod: dict) -> None:
        event = {"type": kind, "object": copy.deepcopy(pod)}
        self.history.append((self.version, event))
        for queue in self._watchers:
            queue.put_nowait(event)

    def _put(self, pod: dict, notify: bool) -> None:
        name = pod["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        pod["metadata"]["resourceVersion"] = self._next_version()
        self.pods[name] = pod
        if notify:
            self._emit(kind, pod)
        else:
            self._expire_history()

    def _delete(self, name: str) -> None:
        pod = self.pods.pop(name)
        pod["metadata"]["resourceVersion"] = self._next_version()
        self._emit("DELETED", pod)

    def _expire(self) -> None:
        self._expire_history()
        for queue in self._watchers:
            queue.put_nowait(_expired(self.version))

    def _expire_history(self) -> None:
        self.history.clear()
        self.oldest_watchable = self.version

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        for queue in self._watchers:
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return _status(401, "Unauthorized", "Unauthorized")
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}, "items": []})
        selector = request.query.get("labelSelector", "")
        self.selectors.add(selector)
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, selector)
        self.lists += 1
        items = [p for p in self.pods.values() if _matches(p, selector)]
        return web.json_response({
            "kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}, "items": items,
        })

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        if since < self.oldest_watchable:
            queue.put_nowait(_expired(self.version))
        else:
            for version, event in self.history:
                if version > since:
                    queue.put_nowait(event)
        self._watchers.add(queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if event is None:
                    break
                if event["type"] != "ERROR" and not _matches(event["object"], selector):
                    continue
                await response.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(queue)
        return response


def _matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _expired(version: int) -> dict:
    return {"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: 1 ({version})", "reason": "Expired", "code": 410,
    }}


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)
