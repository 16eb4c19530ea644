"""``POST /sim/fault``: the failures integration tests inject into a replica.

``{"action": ..., "replica": <index or name, optional: another replica of the fleet>}``. Actions: restart, unhealthy,
healthy, stall (``seconds`` optional), unstall, drop_events (``fraction``), delay_events (``ms``), disable_replay,
enable_replay, reset_cache, stop (close the HTTP listener and cut open connections), start, poison (``marker``: every
generation request whose body holds it is answered 500, as an engine that fails on some content does; null clears).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable, Protocol

from .errors import EngineError
from .replica import SimReplica

After = Callable[[], Awaitable[None]]


class FaultTarget(Protocol):
    """What a fault acts on: one replica's state, its engine restart and its HTTP listener."""

    @property
    def replica(self) -> SimReplica: ...

    def restart(self) -> None: ...

    async def stop_http(self) -> None: ...

    async def start_http(self) -> None: ...


async def apply(
    receiver: FaultTarget, fleet: Iterable[FaultTarget], body: dict[str, Any]
) -> tuple[dict[str, Any], After | None]:
    """Apply a fault to ``receiver`` (the replica the request came to) or to the replica of ``fleet`` that
    ``body["replica"]`` names; returns the answer and, for stop, the coroutine to run once the answer is sent
    (stopping may close the very listener the answer goes out on)."""
    target = _target(receiver, fleet, body.get("replica"))
    state = target.replica
    action = body.get("action")
    after: After | None = None
    engine, publisher = state.engine, state.publisher
    if action == "restart":
        target.restart()
    elif action == "unhealthy":
        state.healthy = False
    elif action == "healthy":
        state.healthy = True
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
        state.poison = None if marker is None else marker.encode()
    else:
        raise EngineError(f"unknown fault action {action!r}", "action")
    return {"replica": state.name, "action": action, "ok": True}, after


def _target(receiver: FaultTarget, fleet: Iterable[FaultTarget], which: Any) -> FaultTarget:
    """The replica a fault names by index or name; None names the replica that received it."""
    if which is None:
        return receiver
    for t in fleet:
        if which == t.replica.index or which == t.replica.name:
            return t
    raise EngineError(f"no replica {which!r} in this fleet", "replica")


def _number(value: Any, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
