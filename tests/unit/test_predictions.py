"""Predictions: what a dispatch leaves behind, and what the engine's answer refutes of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch, Tier
from kvgate.router.routing.predictions import Predictions
from kvgate.router.routing.sessions import SessionMemory

BS = 4


def routed(index: PrefixIndex, chain: list[int], replica: str) -> Any:
    """A request over ``chain``, routed to ``replica`` on what the index held when it was routed."""
    matched = index.lookup(chain, BS).get(replica, PrefixMatch()).total
    return SimpleNamespace(
        request=SimpleNamespace(block_size=BS, tenant=None, session_id=None), block_sizes={replica: BS},
        cache_salt=None, keys_for=lambda name: chain, matched_tokens=lambda name: matched,
    )


def test_an_answer_that_reused_less_refutes_the_blocks_predicted_past_it() -> None:
    index = PrefixIndex(predicted_ttl_s=30.0)
    predictions = Predictions(index, SessionMemory(capacity_per_tenant=4))
    chain = block_keys(namespace_key("m"), list(range(6 * BS)), BS)
    index.store("a", chain[:2], Tier.GPU, 0)
    first = routed(index, chain, "a")
    predictions.dispatched(first, "a")
    second = routed(index, chain, "a")  # credited the whole chain: 2 blocks confirmed, 4 predicted
    assert second.matched_tokens("a") == 6 * BS
    predictions.dispatched(second, "a")
    predictions.refuted(second, "a", reused_tokens=3 * BS)  # the engine held one predicted block, not the rest
    assert index.lookup(chain, BS) == {"a": PrefixMatch(gpu=2 * BS, predicted=BS)}


def test_an_answer_that_reused_all_it_was_credited_refutes_nothing() -> None:
    index = PrefixIndex(predicted_ttl_s=30.0)
    predictions = Predictions(index, SessionMemory(capacity_per_tenant=4))
    chain = block_keys(namespace_key("m"), list(range(4 * BS)), BS)
    predictions.dispatched(routed(index, chain, "a"), "a")
    second = routed(index, chain, "a")
    predictions.refuted(second, "a", reused_tokens=second.matched_tokens("a"))
    assert index.lookup(chain, BS) == {"a": PrefixMatch(predicted=4 * BS)}
    predictions.refuted(routed(index, chain, "a"), "a", reused_tokens=0)  # a cold answer after a credited one
    assert index.lookup(chain, BS) == {}
