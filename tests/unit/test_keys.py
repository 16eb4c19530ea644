"""kvgate's chained block keys: deterministic, prefix-shaped, and isolated per namespace."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.cache_index import keys as keys_module
from kvgate.cache_index.keys import RecentBlockKeys, block_keys, common_prefix, namespace_key

TOKENS = list(range(100, 164))


def test_only_full_blocks_get_keys_and_keys_chain() -> None:
    ns = namespace_key("m")
    keys = block_keys(ns, TOKENS + [1, 2, 3], 16)
    assert len(keys) == 4
    assert block_keys(ns, TOKENS[:32], 16) == keys[:2]
    assert block_keys(ns, TOKENS[:15], 16) == []
    changed = TOKENS.copy()
    changed[20] = 7
    assert block_keys(ns, changed, 16)[:1] == keys[:1]
    assert set(block_keys(ns, changed, 16)[1:]).isdisjoint(keys)


def test_array_input_and_none_extras_match_plain_lists() -> None:
    ns = namespace_key("m")
    keys = block_keys(ns, TOKENS, 16)
    assert block_keys(ns, array("I", TOKENS), 16) == keys
    assert block_keys(ns, TOKENS, 16, [None, None, None, None]) == keys
    assert block_keys(ns, TOKENS, 16, [None]) == keys


def test_extra_keys_change_the_block_and_everything_after_it() -> None:
    ns = namespace_key("m")
    plain = block_keys(ns, TOKENS, 16)
    with_image = block_keys(ns, TOKENS, 16, [None, ("img-1", 0), None, None])
    assert with_image[0] == plain[0]
    assert set(with_image[1:]).isdisjoint(plain)
    assert block_keys(ns, TOKENS, 16, [None, ["img-1", 0]]) == with_image  # lists and tuples agree
    assert block_keys(ns, TOKENS, 16, [None, ("img-2", 0)])[1] != with_image[1]


@pytest.mark.parametrize(
    "other",
    [
        ("m2", "", None, None),
        ("m", "v2", None, None),
        ("m", "", "tenant-a", None),
        ("m", "", None, "adapter"),
        ("m", "", "adapter", None),
    ],
)
def test_namespaces_never_share_keys(other: tuple) -> None:
    base = block_keys(namespace_key("m"), TOKENS, 16)
    assert set(block_keys(namespace_key(*other), TOKENS, 16)).isdisjoint(base)


def test_block_size_is_validated() -> None:
    with pytest.raises(ValueError):
        block_keys(namespace_key("m"), TOKENS, 0)


def test_common_prefix_is_where_two_id_arrays_first_differ() -> None:
    rng = random.Random(5)
    for _ in range(200):
        a = array("I", (rng.randrange(3) for _ in range(rng.randrange(40))))
        b = array("I", a[: rng.randrange(len(a) + 1)]) + array("I", (rng.randrange(3) for _ in range(rng.randrange(5))))
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expected


# A prompt grows from one remembered earlier (same session or not), diverges from it at some point, or is new.
prompt_steps = st.lists(
    st.tuples(
        st.integers(0, 1),  # namespace
        st.sampled_from([None, "s1", "s2"]),  # session
        st.integers(0, 5),  # which earlier prompt it starts from (past the end: a new one)
        st.integers(0, 200),  # how many of that prompt's tokens it keeps
        st.lists(st.integers(0, 3), max_size=120),  # what it adds
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(steps=prompt_steps, block_size=st.sampled_from([1, 4, 16]), max_bytes=st.sampled_from([200, 2_000, 100_000]))
def test_recent_block_keys_are_always_the_keys_block_keys_computes(
    steps: list[tuple[int, str | None, int, int, list[int]]], block_size: int, max_bytes: int,
) -> None:
    """Whatever was remembered, evicted or shared across sessions and namespaces, the keys are exactly the chain's."""
    recent = RecentBlockKeys(max_bytes, min_blocks=1)
    namespaces = [namespace_key("m"), namespace_key("m", cache_salt="tenant-b")]
    prompts: list[array[int]] = []
    for ns_index, session, base, keep, added in steps:
        start = prompts[base][:keep] if base < len(prompts) else array("I")
        tokens = start + array("I", added)
        prompts.append(tokens)
        ns = namespaces[ns_index]
        assert list(recent.keys(ns, tokens, block_size, session)) == block_keys(ns, tokens, block_size)
        assert recent.bytes <= max_bytes


def test_a_prompt_that_extends_a_remembered_one_hashes_only_its_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    recent = RecentBlockKeys(min_blocks=64)
    ns = namespace_key("m")
    turn = array("I", range(1000, 1000 + 64 * 16))  # 64 blocks
    recent.keys(ns, turn[: 63 * 16], 16, "session")  # too short to remember
    assert len(recent) == 0
    recent.keys(ns, turn, 16, "session")
    hashed: list[bytes] = []
    real = keys_module._xxh3_64

    def counted(data: bytes, seed: int = 0) -> int:
        hashed.append(data)
        return real(data, seed)

    monkeypatch.setattr(keys_module, "_xxh3_64", counted)
    next_turn = turn + array("I", range(5, 5 + 40))  # 2 more full blocks and a partial one
    assert list(recent.keys(ns, next_turn, 16, "session")) == block_keys(ns, next_turn, 16)
    # the block_keys call above hashed 66 blocks; the cache, its first block (the look-up) and the 2 new ones
    assert len(hashed) == 3 + 66
    other_tenant = namespace_key("m", cache_salt="other")
    hashed.clear()
    assert list(recent.keys(other_tenant, next_turn, 16, "session")) == block_keys(other_tenant, next_turn, 16)
    assert len(hashed) == 1 + 66 + 66  # nothing reused across namespaces


def test_recent_block_keys_hold_at_most_their_bound() -> None:
    recent = RecentBlockKeys(max_bytes=500, min_blocks=1)  # one 64-token prompt of 16-token blocks: 4 * 64 + 40 * 4
    ns = namespace_key("m")
    recent.keys(ns, array("I", range(1000)), 16)  # larger than the bound: not remembered
    assert len(recent) == 0 and recent.bytes == 0
    for start in range(0, 640, 64):
        recent.keys(ns, array("I", range(start, start + 64)), 16)
        assert recent.bytes <= 500
    assert len(recent) == 1 and recent.bytes == 416
