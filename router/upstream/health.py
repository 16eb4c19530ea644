"""Active health: probe each engine's ``GET /health`` and refresh its ``GET /v1/models``.

One failed probe is not an outage (a GC pause, a busy event loop); one success after an outage is not a recovery
(a crash loop answers between crashes). :class:`HealthState` only flips after ``failures_to_down`` consecutive
failures or ``successes_to_up`` consecutive successes. The very first probe decides at once: at startup there is no
earlier state to protect.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

from kvgate.router.upstream.client import EngineClient, UpstreamError
from kvgate.router.upstream.config import HealthConfig
from kvgate.router.upstream.scrape import NO_COMPRESSION

log = logging.getLogger(__name__)

Transition = Literal["up", "down"]
MAX_MODELS_BYTES = 4 * 1024 * 1024
"""The largest ``/health`` or ``/v1/models`` answer read."""


class HealthState:
    def __init__(self) -> None:
        self.up: bool | None = None
        """None until the first probe answers."""
        self._streak = 0

    def observe(self, ok: bool, config: HealthConfig) -> Transition | None:
        """Record one probe result; returns the transition it caused, if any."""
        if self.up is None:
            self.up = ok
            return "up" if ok else "down"
        if ok == self.up:
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < (config.successes_to_up if ok else config.failures_to_down):
            return None
        self.up = ok
        self._streak = 0
        return "up" if ok else "down"


async def probe_health(client: EngineClient, base_url: str, timeout_s: float) -> bool:
    """True when ``/health`` answers 2xx within the timeout (vLLM answers 503 when its engine is dead)."""
    try:
        answer = await client.fetch("GET", base_url + "/health", timeout_s=timeout_s, max_bytes=MAX_MODELS_BYTES)
        return 200 <= answer.status < 300
    except (UpstreamError, OSError, TimeoutError, ValueError) as e:
        log.debug("health %s failed: %r", base_url, e)
        return False


async def fetch_models(client: EngineClient, base_url: str, timeout_s: float) -> list[dict[str, Any]] | None:
    """The ``data`` entries of ``/v1/models``; ``None`` when unavailable (the previous list is kept)."""
    try:
        answer = await client.fetch("GET", base_url + "/v1/models", NO_COMPRESSION, timeout_s=timeout_s,
                                    max_bytes=MAX_MODELS_BYTES)
        if answer.status != 200:
            return None
        body = msgspec.json.decode(answer.body)
    except (UpstreamError, OSError, TimeoutError, ValueError, msgspec.DecodeError) as e:
        log.debug("models %s failed: %r", base_url, e)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
