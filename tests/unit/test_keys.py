"""kvgate's chained block keys: deterministic, prefix-shaped, and isolated per namespace."""

from __future__ import annotations

from array import array

import pytest

from kvgate.cache_index.keys import block_keys, namespace_key

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
