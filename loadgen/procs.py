"""The one way kvgate's tools run a child process: in its own process group, logging to a file, waited on over HTTP
with a deadline, and stopped by PID (SIGTERM to the group, then SIGKILL to whatever is left).

Used by ``kvgate bench`` (fleets, gateways, peer routers), the real-vLLM launcher (:mod:`kvgate.loadgen.engines`),
``kvgate demo``, the test suites and the benchmarks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

POLL_S = 0.05
"""How often :meth:`ChildProcess.wait_http` asks again."""


def interrupt_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that raises KeyboardInterrupt: a tool stopped by ``kill`` or ``timeout`` then unwinds as on
    Ctrl-C, through the ``finally`` blocks that stop every process it started, instead of leaving them running."""
    raise KeyboardInterrupt


def parse_cpu_list(text: str) -> frozenset[int]:
    """A CPU list as ``taskset -c`` and ``/proc/*/status`` write it (``1``, ``0,2``, ``2-3``); ValueError for
    anything else, or an empty list."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 1, 0,2 or 2-3)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part.strip()} runs backwards)")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def pin_threads(cpus: frozenset[int] | set[int]) -> None:
    """Let every thread of this process run only on ``cpus`` (an affinity is per thread; the ones started later
    inherit it from their creator, as children do)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def answered_200(status: int) -> bool:
    return status == 200


@dataclass
class ChildProcess:
    """A subprocess and its log. ``own_group``: its own session, so it is signalled (and killed) with every process
    it starts; otherwise it stays in its parent's group and only it is signalled. ``log_path`` None: it writes to
    this process's own stdout and stderr."""

    name: str
    args: list[str]
    log_path: Path | None
    env: dict[str, str] = field(default_factory=dict)
    """Environment on top of this process's own (plus ``PYTHONUNBUFFERED=1``)."""
    own_group: bool = True
    cwd: Path | None = None
    url: str = ""
    """Where it serves, once ready (a gateway, an engine)."""
    proc: subprocess.Popen[bytes] | None = None
    cpus: frozenset[int] | None = None
    """The CPUs it may run on, set before it starts so its every thread and child inherits them (None: this
    process's own)."""

    def start(self, *, append: bool = False) -> ChildProcess:
        log: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab" if append else "wb")
        cpus = self.cpus
        try:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT if log is not None else None, cwd=self.cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, start_new_session=self.own_group,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        finally:
            if log is not None:
                log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(
        self, url: str, timeout_s: float, ready: Callable[[int], bool] = answered_200, interval_s: float = POLL_S
    ) -> None:
        """Poll ``url`` until its status satisfies ``ready``; fail early, with the log's tail, if the process exits."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        """The last answer's status, or why there was none."""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early; last output:\n{self.tail()}")
            try:
                status = httpx.get(url, timeout=2.0).status_code
                if ready(status):
                    return
                last = f"HTTP {status}"
            except httpx.HTTPError as e:
                last = e
            time.sleep(interval_s)
        raise TimeoutError(f"{self.name}: {url} not ready after {timeout_s:.0f}s ({last}); last output:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (its whole group when it has its own)."""
        if self.proc is None:
            return
        try:
            if self.own_group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to exit; whether it did."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after ``grace_s`` (the group's stragglers too)."""
        if self.proc is None:
            return
        if self.alive():
            self.signal(signal.SIGTERM)
            self.wait(grace_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is shut down cleanly."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        self.proc.wait(10.0)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None and self.log_path.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def last_line(self) -> str:
        lines = self.tail().strip().splitlines()
        return lines[-1] if lines else ""
