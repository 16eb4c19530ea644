"""Watching for a client that leaves while its request is being answered: the engine then aborts the sequence, when
kvgate closes its connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` when the client closes the connection. Only for requests whose body was already read, so
    ``receive`` has nothing else to report. Run it as a task next to the work it guards."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def left_early(watcher: asyncio.Task[None]) -> bool:
    """Whether a :func:`cancel_on_disconnect` watcher is what cancelled its task (the client left)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


async def while_connected(request: Request, forward: Awaitable[T]) -> T | None:
    """``forward`` (the request's upstream legs, or its wait for capacity), cancelled the moment the client
    disconnects (None then): closing the upstream connection makes the engine abort the sequence, even during a long
    prefill before any byte came back — a handoff's prefill leg included, whose KV would otherwise stay held for a
    decode leg that never comes; a waiting request leaves the gateway's queue.

    The forward runs in the request's own task and only the watcher is a second one, which cancels this task when
    the client leaves: a task for the forward plus ``asyncio.wait`` cost more CPU per request."""
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(cancel_on_disconnect(request.receive, task))
    try:
        return await forward
    except asyncio.CancelledError:
        if left_early(watcher):
            task.uncancel()
            return None
        raise
    finally:
        watcher.cancel()
