"""Watching for a client that leaves while its request is being answered: the engine then aborts the sequence, when
kvgate closes its connection."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` when the client closes the connection. Only for requests whose body was already read, so
    ``receive`` has nothing else to report. Run it as a task next to the work it guards."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def left_early(watcher: asyncio.Task[None]) -> bool:
    """Whether a :func:`cancel_on_disconnect` watcher is what cancelled its task (the client left)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None
