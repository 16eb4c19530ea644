"""``POST /sim/fault``: the failures integration tests inject into a replica.

``{"action": ..., "replica": <index or name, optional: another replica of the fleet>}``. Actions: restart, unhealthy,
healthy, stall (``seconds`` optional), unstall, drop_events (``fraction``), delay_events (``ms``), disable_replay,
enable_replay, reset_cache, stop (close the HTTP listener and cut open connections), start, poison (``marker``: every
generation request whose body holds it is answered 500, as an engine that fails on some content does; null clears).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .errors import EngineError

if TYPE_CHECKING:
    from .fleet import Replica

After = Callable[[], Awaitable[None]]


async def apply(replica: "Replica", body: dict[str, Any]) -> tuple[dict[str, Any], After | None]:
    """Apply a fault; returns the answer and, for stop, the coroutine to run once the answer is sent (stopping
    may close the very listener the answer goes out on)."""
    target = _target(replica, body.get("replica"))
    action = body.get("action")
    after: After | None = None
    engine, publisher = target.engine, target.publisher
    if action == "restart":
        target.restart()
    elif action == "unhealthy":
        target.healthy = False
    elif action == "healthy":
        target.healthy = True
    elif action == "stall":
        seconds = body.get("seconds")
        if seconds is not None and not _number(seconds, 0):
            raise EngineError("seconds must be a non-negative number", "seconds")
        engine.stall(None if seconds is None else float(seconds))
    elif action == "unstall":
        engine.unstall()
    elif action == "drop_events":
        fraction = body.get("fraction", 1.0)
        if not _number(fraction, 0) or fraction > 1:
            raise EngineError("fraction must be a number in [0, 1]", "fraction")
        publisher.drop_fraction = float(fraction)
    elif action == "delay_events":
        ms = body.get("ms", 0)
        if not _number(ms, 0):
            raise EngineError("ms must be a non-negative number", "ms")
        publisher.delay_s = float(ms) / 1000.0
    elif action == "disable_replay":
        publisher.replay_enabled = False
    elif action == "enable_replay":
        publisher.replay_enabled = True
    elif action == "reset_cache":  # as an operator resetting under load would: running requests are preempted
        engine.reset_prefix_cache(reset_running_requests=True)
    elif action == "stop":
        after = target.stop_http
    elif action == "start":
        await target.start_http()
    elif action == "poison":
        marker = body.get("marker")
        if marker is not None and not (isinstance(marker, str) and marker):
            raise EngineError("marker must be a non-empty string or null", "marker")
        target.poison = None if marker is None else marker.encode()
    else:
        raise EngineError(f"unknown fault action {action!r}", "action")
    return {"replica": target.name, "action": action, "ok": True}, after


def _target(replica: "Replica", which: Any) -> "Replica":
    if which is None:
        return replica
    for r in replica.fleet:
        if which == r.index or which == r.name:
            return r
    raise EngineError(f"no replica {which!r} in this fleet", "replica")


def _number(value: Any, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
