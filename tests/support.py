"""Real processes on loopback for integration tests: start `kvgate sim` / `kvgate serve`, wait until ready, and
always kill them by PID (their whole process group) when the test is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadgen.bench import free_port_block

KVGATE = [sys.executable, "-m", "router.cli"]
REPO = Path(__file__).resolve().parent.parent


@dataclass
class ManagedProcess:
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> "ManagedProcess":
        self.log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.args} exited early:\n{self.output()[-4000:]}")
            try:
                if httpx.get(url, timeout=1.0).status_code < 500:
                    return
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.05)
        raise TimeoutError(f"{url} not ready after {timeout}s ({last}):\n{self.output()[-4000:]}")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left."""
        if self.proc is None:
            return
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout)
        self.log.close()


@dataclass
class Sim:
    process: ManagedProcess
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
    proc = ManagedProcess(args, tmp_path / f"sim-{http_port}.log").start()
    sim = Sim(proc, replicas, http_port, zmq_port, config)
    try:
        for i in range(replicas):
            proc.wait_http(sim.url(i) + "/health", timeout)
    except Exception:
        proc.stop()
        raise
    return sim


@dataclass
class Gateway:
    process: ManagedProcess
    port: int
    config_path: Path
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def start_kvgate(tmp_path: Path, config_path: Path, *extra: str, timeout: float = 30.0) -> Gateway:
    port = free_port_block(1)
    args = [*KVGATE, "serve", "--config", str(config_path), "--port", str(port), *extra]
    proc = ManagedProcess(args, tmp_path / f"kvgate-{port}.log").start()
    gw = Gateway(proc, port, config_path, list(extra))
    try:
        proc.wait_http(gw.url + "/health", timeout)
    except Exception:
        proc.stop()
        raise
    return gw
