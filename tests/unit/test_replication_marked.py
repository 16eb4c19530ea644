"""What the gateway's replication records of a dispatched request: the deepest prefix a replica holds and, when the
client marked one (Anthropic ``cache_control`` on its system), the shared prefix every session starts with."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from kvgate.router.routing.replication import Replication

BLOCK = 16


class Tracker:
    def __init__(self) -> None:
        self.recorded: list[tuple[int, int, set[str]]] = []

    def record(self, key: int, tokens: int, holders: set[str], now: float) -> None:
        self.recorded.append((key, tokens, holders))

    def heat_ms_per_s(self, key: int, cost_model: Any, now: float) -> float:
        return 0.0


def routed(shared_tokens: int, depths: dict[str, int], tracker: Tracker) -> Any:
    tokens = 20 * BLOCK
    views = {name: SimpleNamespace(name=name, match=SimpleNamespace(total=depth)) for name, depth in depths.items()}
    return SimpleNamespace(
        request=SimpleNamespace(block_size=BLOCK, model="m"), views=views, block_sizes=dict.fromkeys(depths, BLOCK),
        keys=list(range(100, 120)), routing=SimpleNamespace(hot=tracker, cost_model=None), cache_salt=None,
        tokenized=SimpleNamespace(token_ids=array("I", range(tokens)), shared_tokens=shared_tokens),
    )


def replication(marked_prefixes: bool) -> Replication:
    settings = SimpleNamespace(replication=SimpleNamespace(marked_prefixes=marked_prefixes, min_saving_ms_per_s=1.0))
    return Replication(SimpleNamespace(settings=settings), *([None] * 6), spawn=lambda _: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("enabled", [True, False])
def test_a_marked_shared_prefix_is_recorded_beside_the_deepest_held_one(enabled: bool) -> None:
    tracker = Tracker()
    # The session's own replica holds 18 blocks; two others hold the 5-block system prompt (and a block beyond).
    replication(enabled).record(routed(5 * BLOCK + 3, {"own": 18 * BLOCK, "b": 6 * BLOCK, "c": 5 * BLOCK}, tracker))
    deepest = (117, 18 * BLOCK, {"own"})
    assert tracker.recorded == ([deepest, (104, 5 * BLOCK, {"own", "b", "c"})] if enabled else [deepest])


def test_a_mark_no_shorter_than_the_deepest_prefix_adds_nothing() -> None:
    tracker = Tracker()
    replication(True).record(routed(10 * BLOCK, {"a": 4 * BLOCK}, tracker))
    assert tracker.recorded == [(103, 4 * BLOCK, {"a"})]
    tracker.recorded.clear()
    replication(True).record(routed(10 * BLOCK, {"a": 0}, tracker))  # nothing held anywhere: nothing to record
    assert tracker.recorded == []
