"""Recording the walk one request takes through kvgate's own files, with a profile hook (``sys.setprofile``).

Only the request's own asyncio task is followed (the one that runs the gateway's ASGI app for it; uvicorn runs each
request in its own), so the health, scrape and event loops running beside it do not show. A coroutine resumed after
an ``await`` is the same visit, not a new call: a frame counts when it first starts.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "policies", "cache_index")


def repo_file(frame: FrameType) -> str | None:
    """``router/pipeline/parse.py`` for a frame in kvgate's own code, else None."""
    path = Path(frame.f_code.co_filename)
    try:
        rel = path.relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in PACKAGES else None


@dataclass
class Call:
    task: int
    caller: str | None
    """The nearest kvgate file below the new frame on the stack (library frames between them are skipped)."""
    callee: str
    function: str


@dataclass
class WalkRecorder:
    """Every new kvgate frame, with the task it ran in and the kvgate file that called it."""

    calls: list[Call] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)
    _frames: list[FrameType] = field(default_factory=list)  # kept alive so that ids are not reused

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or id(frame) in self._seen:
            return
        callee = repo_file(frame)
        if callee is None:
            return
        self._seen.add(id(frame))
        self._frames.append(frame)
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        caller, back = None, frame.f_back
        while back is not None and caller is None:
            caller = repo_file(back)
            back = back.f_back
        self.calls.append(Call(id(task), caller, callee, frame.f_code.co_qualname))

    def start(self) -> None:
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        self._frames.clear()

    def request_calls(self, entry_function: str) -> list[Call]:
        """The calls made in the task whose first kvgate frame was ``entry_function`` (the request's)."""
        tasks = {c.task for c in self.calls if c.function == entry_function}
        assert len(tasks) == 1, f"{entry_function} ran in {len(tasks)} tasks"
        (task,) = tasks
        return [c for c in self.calls if c.task == task]


def visits(files: list[str]) -> list[str]:
    """The files in the order they were entered, consecutive repeats folded into one visit."""
    out: list[str] = []
    for f in files:
        if not out or out[-1] != f:
            out.append(f)
    return out


def walk_summary(calls: list[Call]) -> tuple[int, int, int, Counter[str]]:
    """File-level stops (each change of file between consecutive new frames or their callers), distinct files, and
    re-entries into a file already left, per file."""
    stops: list[str] = []
    for c in calls:
        for f in (c.caller, c.callee):
            if f is not None and (not stops or stops[-1] != f):
                stops.append(f)
    entered: set[str] = set()
    reentries: Counter[str] = Counter()
    for f in stops:
        if f in entered:
            reentries[f] += 1
        entered.add(f)
    return len(stops), len(entered), sum(reentries.values()), reentries


LAYERS = ["cli", "app", "gateway", "endpoints", "settings", "peers", "pipeline", "admission", "indexing", "routing",
          "fleet", "apis", "upstream", "prompts", "core"]
"""``router/``'s folders from the top (pyproject.toml's layers contract, siblings in some order); policies and
cache_index sit below them all."""


def layer_of(path: str) -> int:
    parts = path.removesuffix(".py").split("/")
    if parts[0] != "router":
        return len(LAYERS) + (parts[0] == "cache_index")
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else LAYERS.index(parts[1].split(".")[0])


def upward_calls(calls: list[Call]) -> list[Call]:
    """Calls from a lower layer into a higher one (a callback handed down, or a listener)."""
    return [c for c in calls if c.caller is not None and layer_of(c.caller) > layer_of(c.callee)]
