"""EventIngestor: sequence rules, generations, salts and LoRA namespaces, orphans, removals."""

from __future__ import annotations

import msgspec
import pytest

from cache_index.index import PrefixIndex
from cache_index.ingest import ApplyStatus, EventIngestor
from cache_index.keys import block_keys, namespace_key
from cache_index.match import PrefixMatch
from cache_index.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4
TOKENS = list(range(500, 516))  # four blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int], **fields: object) -> BlockStored:
    defaults: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None}
    return BlockStored(hashes, parent, tokens, BS, **{**defaults, **fields})


def frame(*events: object, dp_rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=dp_rank))


def chain(first_hash: int = 1, tokens: list[int] = TOKENS, **fields: object) -> bytes:
    hashes = list(range(first_hash, first_hash + len(tokens) // BS))
    return frame(stored(hashes, None, tokens, **fields))


@pytest.fixture
def setup() -> tuple[PrefixIndex, EventIngestor]:
    index = PrefixIndex()
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    return index, ingestor


def held(index: PrefixIndex, salt: str | None = None, lora: str | None = None, version: str = "") -> int:
    match = index.lookup(block_keys(namespace_key("m", version, salt, lora), TOKENS, BS), BS).get("r")
    return 0 if match is None else match.total


def test_in_order_frames_apply_and_duplicates_are_discarded(setup) -> None:
    index, ingestor = setup
    assert ingestor.apply("r", 5, chain()).status is ApplyStatus.APPLIED  # first seq seen is accepted
    assert ingestor.apply("r", 6, frame(BlockRemoved([4], "GPU"))).status is ApplyStatus.APPLIED
    assert held(index) == 12
    assert ingestor.apply("r", 5, chain(), source="http").status is ApplyStatus.DUPLICATE  # never double-counted
    assert held(index) == 12
    assert ingestor.stats.dropped["duplicate"] == 1
    assert ingestor.expected_seq("r", None) == 7


def test_on_a_live_zmq_stream_only_frames_a_replay_delivered_are_duplicates(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain(tokens=TOKENS[:4]))
    assert ingestor.apply("r", 3, frame()).status is ApplyStatus.GAP
    for seq in (1, 2, 3, 4):
        assert ingestor.apply("r", seq, frame(), source="replay").applied
    assert ingestor.apply("r", 3, frame()).status is ApplyStatus.DUPLICATE  # buffered while replaying
    assert ingestor.apply("r", 4, frame()).status is ApplyStatus.DUPLICATE
    assert ingestor.apply("r", 5, frame()).applied
    assert held(index) == 4
    # an engine that restarted while we were reconnecting: its frames 0..2 were missed
    assert ingestor.apply("r", 3, chain(first_hash=40, tokens=TOKENS[:8])).status is ApplyStatus.RESTARTED
    assert held(index) == 8


def test_gap_holds_everything_until_repaired(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain(tokens=TOKENS[:8]))
    result = ingestor.apply("r", 2, frame(stored([3], 2, TOKENS[12:16])))
    assert (result.status, result.expected, result.got) == (ApplyStatus.GAP, 1, 2)
    assert ingestor.apply("r", 3, frame()).status is ApplyStatus.GAP
    assert ingestor.stats.gaps_detected == 1
    assert held(index) == 8
    # the replayed frames arrive in order and are applied
    assert ingestor.apply("r", 1, frame(stored([9], 2, TOKENS[8:12]))).applied
    assert ingestor.apply("r", 2, frame(stored([3], 9, TOKENS[12:16]))).applied
    assert held(index) == 16


def test_purge_after_failed_repair_drops_holdings_and_resumes(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain())
    assert ingestor.apply("r", 4, frame()).status is ApplyStatus.GAP
    ingestor.purge("r")
    assert held(index) == 0
    assert ingestor.apply("r", 4, chain(first_hash=20)).applied
    assert held(index) == 16
    assert ingestor.stats.purges == 1


def test_sequence_back_to_zero_is_a_restart(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain())
    ingestor.apply("r", 1, frame())
    generation = ingestor.generation("r")
    result = ingestor.apply("r", 0, chain(tokens=TOKENS[:4], first_hash=50))
    assert result.status is ApplyStatus.RESTARTED
    assert ingestor.generation("r") == generation + 1
    assert held(index) == 4  # only what the restarted engine reported
    assert ingestor.stats.restarts == 1


def test_over_http_a_big_jump_back_is_a_restart() -> None:
    index = PrefixIndex()
    ingestor = EventIngestor(index, duplicate_window=10)
    ingestor.add_replica("r", model="m")
    ingestor.apply("r", 100, chain())
    assert ingestor.apply("r", 95, frame(), source="http").status is ApplyStatus.DUPLICATE
    assert ingestor.apply("r", 50, frame(), source="http").status is ApplyStatus.RESTARTED
    assert held(index) == 0


def test_frames_of_an_old_generation_are_stale(setup) -> None:
    index, ingestor = setup
    generation = ingestor.generation("r")
    ingestor.reset_replica("r", "health")
    assert ingestor.apply("r", 0, chain(), generation=generation).status is ApplyStatus.STALE
    assert held(index) == 0
    assert ingestor.stats.dropped["stale_generation"] == 1
    assert ingestor.stats.resets["health"] == 1


def test_reset_drops_holdings_and_forgets_engine_hashes(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain(tokens=TOKENS[:8]))
    ingestor.reset_replica("r", "drain")
    assert held(index) == 0
    ingestor.apply("r", 1, frame(stored([3], 2, TOKENS[8:12])))  # parent known only to the old generation
    assert held(index) == 0
    assert ingestor.stats.dropped["orphan"] == 1


def test_dp_ranks_have_their_own_sequences(setup) -> None:
    index, ingestor = setup
    assert ingestor.apply("r", 0, chain(tokens=TOKENS[:4]), dp_rank=0).applied
    assert ingestor.apply("r", 7, frame(stored([2], 1, TOKENS[4:8])), dp_rank=1).applied
    assert ingestor.apply("r", 1, frame(), dp_rank=0).applied
    assert held(index) == 8


def test_namespace_change_drops_everything(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain())
    ingestor.set_namespace("r", "m", "v2")
    assert held(index) == 0 and held(index, version="v2") == 0
    ingestor.apply("r", 1, chain(first_hash=30))
    assert held(index, version="v2") == 16 and held(index) == 0


def test_vllm_block0_salt_and_sglang_salt_field_agree_with_request_namespaces(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, frame(stored([1, 2, 3, 4], None, TOKENS, extra_keys=[("tenant-a",), None, None, None])))
    assert held(index, salt="tenant-a") == 16
    assert held(index) == 0 and held(index, salt="tenant-b") == 0
    ingestor.reset_replica("r", "test")
    sglang_stored = {"type": "BlockStored", "block_hashes": [1, 2, 3, 4], "parent_block_hash": None,
                     "token_ids": TOKENS, "block_size": BS, "lora_id": None, "medium": "GPU", "cache_salt": "tenant-b"}
    ingestor.apply("r", 0, msgspec.msgpack.encode([1.0, [sglang_stored], 0]))
    assert held(index, salt="tenant-b") == 16 and held(index, salt="tenant-a") == 0


def test_lora_name_roots_its_own_namespace_and_is_not_taken_for_a_salt(setup) -> None:
    index, ingestor = setup
    extra = [("adapter-1", "tenant-a"), ("adapter-1",), ("adapter-1",), ("adapter-1",)]
    ingestor.apply("r", 0, frame(stored([1, 2, 3, 4], None, TOKENS, lora_name="adapter-1", extra_keys=extra)))
    assert held(index, salt="tenant-a", lora="adapter-1") == 16
    assert held(index, lora="adapter-1") == 0 and held(index, salt="tenant-a") == 0


def test_lora_entries_published_with_their_path_are_recognised(setup) -> None:
    index, ingestor = setup
    extra = [(["adapter-1", "/loras/a1"], "tenant-a"), (["adapter-1", "/loras/a1"],), None, None]
    ingestor.apply("r", 0, frame(stored([1, 2, 3, 4], None, TOKENS, lora_name="adapter-1", extra_keys=extra)))
    assert held(index, salt="tenant-a", lora="adapter-1") == 16


def test_multimodal_extra_keys_never_match_text_only_requests(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, frame(stored([1, 2, 3, 4], None, TOKENS, extra_keys=[None, [["img", 0]], None, None])))
    assert held(index) == 4


def test_removal_is_per_tier_and_clears_the_engine_hash_only_when_nothing_is_left(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain(tokens=TOKENS[:8]))
    ingestor.apply("r", 1, frame(stored([2], 1, TOKENS[4:8], medium="CPU")))
    ingestor.apply("r", 2, frame(BlockRemoved([2], "GPU")))
    keys = block_keys(namespace_key("m"), TOKENS, BS)
    assert index.lookup(keys, BS) == {"r": PrefixMatch(gpu=4, cpu=4)}
    ingestor.apply("r", 3, frame(BlockRemoved([2], "CPU")))
    ingestor.apply("r", 4, frame(stored([3], 2, TOKENS[8:12])))  # hash 2 is gone: orphan
    assert index.lookup(keys, BS) == {"r": PrefixMatch(gpu=4)}
    assert ingestor.stats.dropped["orphan"] == 1
    ingestor.apply("r", 5, frame(BlockRemoved([77], "GPU")))
    assert ingestor.stats.unknown_removed == 1


def test_all_blocks_cleared_bumps_the_generation(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain())
    generation = ingestor.generation("r")
    ingestor.apply("r", 1, frame(AllBlocksCleared()))
    assert held(index) == 0 and ingestor.generation("r") == generation + 1
    assert ingestor.apply("r", 2, chain()).applied  # the stream itself continues
    assert held(index) == 16


def test_unknown_media_sliding_window_groups_and_short_token_lists_are_skipped(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain(medium="TAPE"))
    ingestor.apply("r", 1, chain(kv_cache_spec_kind="sliding_window"))
    ingestor.apply("r", 2, frame(stored([1, 2], None, TOKENS[:6])))
    assert held(index) == 0
    assert ingestor.stats.dropped["unknown_medium"] == 1
    assert ingestor.stats.dropped["other_kv_group"] == 1
    assert ingestor.stats.dropped["malformed"] == 1


def test_unknown_replica_and_removed_replica(setup) -> None:
    index, ingestor = setup
    assert ingestor.apply("x", 0, chain()).status is ApplyStatus.UNKNOWN_REPLICA
    ingestor.apply("r", 0, chain())
    ingestor.remove_replica("r")
    assert held(index) == 0 and "r" not in ingestor.stats.generations
    ingestor.add_replica("r", model="m")
    assert ingestor.generation("r") == 1  # a re-added replica never reuses a generation
    assert index.generation("r") == 1  # known to the index (explain reads it there) before any event
    assert ingestor.block_size("r") is None


def test_block_size_is_learned_from_events(setup) -> None:
    _, ingestor = setup
    ingestor.apply("r", 0, chain())
    assert ingestor.block_size("r") == BS
