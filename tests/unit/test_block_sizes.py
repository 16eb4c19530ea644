"""BlockSizes: a replica's block size from its events, else its scraped cache_config_info, else the policy file."""

from __future__ import annotations

import pytest

from kvgate.cache_index.match import reusable_blocks
from kvgate.router.core.config import ModelConfig
from kvgate.router.fleet.block_sizes import BlockSizes


def test_events_then_scrape_then_the_policy_files_default() -> None:
    events: dict[str, int] = {}
    scraped: dict[str, int] = {}
    sizes = BlockSizes(events.get, scraped.get)
    unstated = ModelConfig(name="m")
    assert sizes.of("r", unstated) == 16 and sizes.of("r", None) == 16
    scraped["r"] = 32
    assert sizes.of("r", unstated) == 32
    events["r"] = 64
    assert sizes.of("r", unstated) == 64
    assert sizes.stats() == {"block_size": {"r": 64}, "mismatch": {"r": 0}}  # a default contradicts nothing


def test_a_stated_block_size_the_engine_contradicts_is_logged_once_and_metered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scraped = {"r": 32}
    sizes = BlockSizes(lambda _: None, scraped.get)
    stated = ModelConfig(name="m", block_size=16)
    with caplog.at_level("WARNING", logger="kvgate.block_sizes"):
        for _ in range(3):
            assert sizes.of("r", stated) == 32
    assert [r.getMessage() for r in caplog.records] == [
        "replica r: the policy file says block_size 16, the engine uses 32; keying its lookups with 32"]
    assert sizes.stats() == {"block_size": {"r": 32}, "mismatch": {"r": 1}}
    scraped["r"] = 16
    assert sizes.of("r", stated) == 16
    assert sizes.stats()["mismatch"] == {"r": 0}


@pytest.mark.parametrize(
    ("prompt_tokens", "block_size", "blocks"),
    [(3008, 32, 93), (3009, 32, 94), (3007, 32, 93), (32, 32, 0), (33, 32, 1), (1, 16, 0), (0, 16, 0)],
)
def test_a_prompt_ending_on_a_block_boundary_reuses_one_block_less(
    prompt_tokens: int, block_size: int, blocks: int
) -> None:
    assert reusable_blocks(prompt_tokens, block_size) == blocks


def test_a_block_size_no_longer_stated_after_a_reload_is_no_mismatch() -> None:
    sizes = BlockSizes(lambda _: 32, lambda _: None)
    assert sizes.of("r", ModelConfig(name="m", block_size=16)) == 32
    assert sizes.stats()["mismatch"] == {"r": 1}
    assert sizes.of("r", ModelConfig(name="m")) == 32
    assert sizes.stats()["mismatch"] == {"r": 0}
