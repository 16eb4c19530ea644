"""Watching for a client that leaves while its request is being answered: the engine then aborts the sequence, when
kvgate closes its connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from kvgate.router.core.http import HttpRequest

T = TypeVar("T")


async def while_connected(request: HttpRequest, work: Awaitable[T]) -> T | None:
    """``work`` (the request's upstream legs, or its wait for capacity), cancelled the moment the client disconnects
    (None then): closing the upstream connection makes the engine abort the sequence, even during a long prefill
    before any byte came back — a handoff's prefill leg included, whose KV would otherwise stay held for a decode leg
    that never comes; a waiting request leaves the gateway's queue.

    The work runs in the request's own task, which the request cancels when its client leaves
    (:meth:`~kvgate.router.core.http.HttpRequest.guard`): no second task watches for it."""
    if not request.guard():
        if asyncio.iscoroutine(work):
            work.close()
        return None
    try:
        result = await work
    except asyncio.CancelledError:
        if request.unguard():
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            return None
        raise
    request.unguard()
    return result
