"""Real processes on loopback for integration tests: start `kvgate sim` / `kvgate serve`, wait until ready, and
always kill them by PID (their whole process group) when the test is done."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import httpx

from kvgate.loadgen.bench import free_port_block
from kvgate.loadgen.procs import ChildProcess

KVGATE = [sys.executable, "-m", "kvgate.router.cli"]
REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.02
"""How often the wait helpers look again: short next to any deadline, long enough not to load the machine."""

T = TypeVar("T")


class ManualClock:
    """A clock a test moves by hand (``clock.now += 1.0``), for code that takes ``clock: Callable[[], float]``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(
    probe: Callable[[], T], what: str = "the condition", timeout: float = 15.0, interval: float = POLL_S
) -> T:
    """Poll ``probe`` until it returns something truthy and return that; fail naming ``what`` at the deadline.
    For tests outside an event loop (the loop would not run while this blocks)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_until_async(
    probe: Callable[[], T | Awaitable[T]], what: str = "the condition", timeout: float = 15.0
) -> T:
    """:func:`wait_until` for async tests: the event loop runs between polls, and ``probe`` may be a coroutine
    function (an HTTP request made on the test's own loop)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL_S)


PROBE_TOKENS = [3] * 16
"""One block of a token no test prompt uses: what :meth:`Sim.reset_and_step` computes to make a replica publish."""


@dataclass
class Sim:
    process: ChildProcess
    replicas: int
    http_port: int
    zmq_port: int
    config_path: Path

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http_port + i}"

    def events_endpoint(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port + 2 * i}"

    def replay_endpoint(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port + 2 * i + 1}"

    def reset_and_step(self, i: int) -> None:
        """Reset replica i's prefix cache and make it publish: like vLLM, it sends ``AllBlocksCleared`` only with
        its next scheduler step, so a one-block request follows (its block is all the cache holds afterwards)."""
        reset = httpx.post(self.url(i) + "/reset_prefix_cache", timeout=2)
        assert reset.json() == {"success": True}, reset.text  # refused while a request holds blocks
        body = {"model": "kvgate-sim", "prompt": PROBE_TOKENS, "max_tokens": 1}
        httpx.post(self.url(i) + "/v1/completions", json=body, timeout=5)

    def stop(self) -> None:
        self.process.stop()


def start_sim(tmp_path: Path, replicas: int = 2, *extra: str, timeout: float = 30.0) -> Sim:
    http_port = free_port_block(replicas)
    zmq_port = free_port_block(2 * replicas)
    config = tmp_path / f"fleet-{http_port}.yaml"
    args = [
        *KVGATE, "sim", "--replicas", str(replicas), "--port", str(http_port), "--zmq-port", str(zmq_port),
        "--write-config", str(config), *extra,
    ]
    proc = ChildProcess(f"kvgate sim :{http_port}", args, tmp_path / f"sim-{http_port}.log", cwd=REPO).start()
    sim = Sim(proc, replicas, http_port, zmq_port, config)
    try:
        for i in range(replicas):
            proc.wait_http(sim.url(i) + "/health", timeout, interval_s=POLL_S)
    except Exception:
        proc.stop()
        raise
    return sim


@dataclass
class Gateway:
    process: ChildProcess
    port: int
    config_path: Path
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def start_kvgate(
    tmp_path: Path, config_path: Path, *extra: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> Gateway:
    """``kvgate serve`` on a free port, ready; ``env`` is added to this process's environment."""
    port = free_port_block(1)
    args = [*KVGATE, "serve", "--config", str(config_path), "--port", str(port), *extra]
    proc = ChildProcess(f"kvgate serve :{port}", args, tmp_path / f"kvgate-{port}.log", env=env or {},
                        cwd=REPO).start()
    gw = Gateway(proc, port, config_path, list(extra))
    try:
        proc.wait_http(gw.url + "/health", timeout, interval_s=POLL_S)
    except Exception:
        proc.stop()
        raise
    return gw


def admin_replicas(gw: Gateway, admin_token: str) -> dict[str, dict[str, Any]]:
    """``GET /admin/replicas``, by name."""
    resp = httpx.get(gw.url + "/admin/replicas", headers={"Authorization": f"Bearer {admin_token}"}, timeout=5)
    resp.raise_for_status()
    return {r["name"]: r for r in resp.json()["data"]}


def routable_replicas(gw: Gateway, admin_token: str) -> set[str]:
    return {name for name, r in admin_replicas(gw, admin_token).items() if r["routable"]}


def request_log_line(gw: Gateway, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """kvgate's request log line of ``request_id``, waited for (lines are flushed in batches)."""

    def find() -> dict[str, Any] | None:
        for line in gw.process.output().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("logger") == "kvgate.requests" and record.get("id") == request_id:
                    return record
        return None

    return wait_until(find, f"the request log line of {request_id}", timeout=timeout)
