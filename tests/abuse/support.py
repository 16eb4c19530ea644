"""Helpers of the abuse suite: hostile requests sent while a probe measures how long the gateway's loop is held."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support import Sim

LOOP_BLOCK_LIMIT_S = 0.05
"""No single request may hold the gateway's event loop longer than this: a ``/health`` probe sent meanwhile is
answered within it. The hostile requests this suite sends held the loop for hundreds of milliseconds to seconds
before they were bounded, refused up front or moved off the loop."""
PROBE_TRIES = 3
"""A shared, noisy machine can delay one probe by itself; a request that really blocks the loop does it every try."""


def gateway_config(sim: Sim, directory: Path, name: str, **sections: Any) -> Path:
    """The sim's policy file with fast health checks, plus section overrides."""
    config = yaml.safe_load(sim.config_path.read_text())
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    path = directory / name
    path.write_text(yaml.safe_dump(config))
    return path


class LoopProbe:
    """Sends ``GET /health`` back to back on one keep-alive connection from a thread and keeps the slowest answer's
    time: any stretch the gateway's event loop is held shows up as a probe that waited that long."""

    def __init__(self, url: str) -> None:
        self.url = url + "/health"
        self.slowest_s = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoopProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                client.get(self.url)
                self.slowest_s = max(self.slowest_s, time.perf_counter() - started)
                self.answers += 1


def without_blocking_the_loop(url: str, hostile: Callable[[], httpx.Response]) -> httpx.Response:
    """``hostile()``'s response, after checking that the gateway kept answering a probe within
    :data:`LOOP_BLOCK_LIMIT_S` while it ran (in one of :data:`PROBE_TRIES` tries)."""
    slowest: list[float] = []
    for _ in range(PROBE_TRIES):
        with LoopProbe(url) as probe:
            deadline = time.monotonic() + 5
            while probe.answers < 3 and time.monotonic() < deadline:  # the probe's connection is up and warm
                time.sleep(0.01)
            probe.slowest_s = 0.0
            response = hostile()
        slowest.append(probe.slowest_s)
        if probe.slowest_s < LOOP_BLOCK_LIMIT_S:
            return response
    raise AssertionError(f"a probe waited {min(slowest) * 1000:.0f} ms or more in every try ({slowest})")


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error
