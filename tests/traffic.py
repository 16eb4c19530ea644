"""Steady client traffic through a gateway while a test changes the fleet: the official openai client in a few
threads, no client retries, every request's replica, timing and error recorded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import openai

MODEL = "kvgate-sim"


@dataclass(frozen=True)
class Outcome:
    started: float
    finished: float
    replica: str | None
    error: str | None


class Traffic:
    def __init__(self, base_url: str, threads: int = 3, max_requests: int = 20_000) -> None:
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._budget = max_requests
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            with self._lock:
                if self._budget <= 0:
                    return
                self._budget -= 1
            n += 1
            started = time.monotonic()
            replica = error = None
            try:
                raw = self.client.completions.with_raw_response.create(
                    model=MODEL, prompt=f"worker {worker} request {n}: tell me about discovery", max_tokens=4,
                )
                raw.parse()
                replica = raw.headers.get("x-kvgate-replica")
            except openai.OpenAIError as e:
                error = f"{type(e).__name__}: {e}"
            with self._lock:
                self.outcomes.append(Outcome(started, time.monotonic(), replica, error))

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def errors(self) -> list[str]:
        return [o.error for o in self.snapshot() if o.error is not None]

    def first_answer_from(self, replica: str, after: float) -> float | None:
        """When the first request started after ``after`` and answered by ``replica`` finished."""
        times = [o.finished for o in self.snapshot() if o.replica == replica and o.started >= after]
        return min(times) if times else None

    def last_start_on(self, replica: str) -> float | None:
        times = [o.started for o in self.snapshot() if o.replica == replica]
        return max(times) if times else None

    def wait_for_answers(self, count: int, after: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(1 for o in self.snapshot() if o.started >= after) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} answers within {timeout}s")
            time.sleep(0.02)
