"""EventIngestor: sequence rules, generations, salts and LoRA namespaces, orphans, removals."""

from __future__ import annotations

import msgspec
import pytest

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import ApplyStatus, EventIngestor
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import PrefixMatch
from kvgate.loadgen.sim.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

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


def test_one_frame_applies_its_stores_and_removals_in_order(setup) -> None:
    """vLLM publishes a BlockRemoved per evicted block, often many in a row: a run is applied at once, and only
    between the stores around it."""
    index, ingestor = setup
    keys = block_keys(namespace_key("m"), TOKENS, BS)
    ingestor.apply("r", 0, frame(
        stored([1, 2], None, TOKENS[:8]),
        BlockRemoved([2], "GPU"), BlockRemoved([1], "GPU"),  # the whole chain evicted...
        stored([1], None, TOKENS[:4]),  # ...then its head computed again
        BlockRemoved([77], "GPU"), BlockRemoved([1], "CPU"),  # unknown, and a tier it is not held in
    ))
    assert index.lookup(keys, BS) == {"r": PrefixMatch(gpu=4)}
    assert ingestor.stats.unknown_removed == 1
    assert ingestor.stats.events_applied == 6
    ingestor.apply("r", 1, frame(stored([5], 1, TOKENS[4:8]), BlockRemoved([5], "GPU"), BlockRemoved([1], "GPU")))
    assert index.lookup(keys, BS) == {}
    ingestor.apply("r", 2, frame(stored([6], 1, TOKENS[4:8])))  # hash 1 left the engine-hash map: an orphan now
    assert ingestor.stats.dropped["orphan"] == 1


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


def test_a_malformed_payload_with_the_next_sequence_number_keeps_the_holdings(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, chain())
    result = ingestor.apply("r", 1, b"\xc1 not msgpack")
    assert result.status is ApplyStatus.MALFORMED and result.generation == ingestor.generation("r")
    assert held(index) == 16 and ingestor.stats.purges == 0
    assert ingestor.apply("r", 2, frame()).status is ApplyStatus.APPLIED  # its number was taken: no gap
    assert held(index) == 16


def test_malformed_frames_are_logged_with_replica_and_reason_at_most_once_per_interval(
    setup, caplog: pytest.LogCaptureFixture
) -> None:
    _, ingestor = setup
    with caplog.at_level("WARNING", logger="kvgate.cache_index.ingest"):
        for seq in range(5):
            ingestor.apply("r", seq, b"\xc1" + b"x" * 10_000)
        ingestor.apply("r", 5, frame(stored([1, 2], None, TOKENS[:5])))  # 2 hashes, 5 token ids
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("kv-events r: malformed, ignored: frame 0: not msgpack")
    assert len(lines[0]) < 400  # the sender's bytes are not echoed at length
    assert ingestor.stats.dropped["malformed"] == 6


def timed(ts: float, *events: object) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0))


def test_a_restart_seen_only_in_the_process_start_time_drops_the_holdings(setup) -> None:
    """The engine restarted and has published nothing yet (or its first frames were missed)."""
    index, ingestor = setup
    ingestor.apply("r", 0, timed(100.0, stored([1, 2, 3, 4], None, TOKENS)))
    generation = ingestor.generation("r")
    assert ingestor.engine_started("r", 150.0)
    assert held(index) == 0 and ingestor.generation("r") == generation + 1 and ingestor.stats.restarts == 1
    # the old engine's last frame, still in flight, is stale: its batch predates the new process
    assert ingestor.apply("r", 1, timed(149.0, stored([9], 4, TOKENS[:4]))).status is ApplyStatus.STALE
    assert ingestor.apply("r", 0, timed(152.0, stored([7, 8], None, TOKENS[:8]))).applied
    assert held(index) == 8 and ingestor.stats.restarts == 1


def test_a_restart_the_sequence_already_showed_is_not_counted_twice(setup) -> None:
    index, ingestor = setup
    ingestor.apply("r", 0, timed(100.0, stored([1, 2, 3, 4], None, TOKENS)))
    ingestor.apply("r", 1, timed(101.0))
    assert ingestor.apply("r", 0, timed(150.5, stored([7, 8], None, TOKENS[:8]))).status is ApplyStatus.RESTARTED
    generation = ingestor.generation("r")
    assert not ingestor.engine_started("r", 150.0)  # the new engine's own frames began this generation
    assert held(index) == 8 and ingestor.generation("r") == generation and ingestor.stats.restarts == 1


def test_frames_that_followed_a_health_reset_are_not_trusted_across_a_restart(setup) -> None:
    """A generation that began with a frame less than the clock margin after the process start may hold the old
    engine's frames (the scraped start time is up to a second early): it is dropped."""
    index, ingestor = setup
    ingestor.reset_replica("r", "recovered")
    ingestor.apply("r", 5, timed(150.2, stored([1, 2, 3, 4], None, TOKENS)))
    assert ingestor.engine_started("r", 150.0)
    assert held(index) == 0
    ingestor.reset_replica("r", "recovered")
    ingestor.apply("r", 0, timed(160.0, stored([1, 2, 3, 4], None, TOKENS)))  # long after: the new engine's
    assert not ingestor.engine_started("r", 150.0) and held(index) == 16


def test_a_recovery_keeps_only_what_the_running_process_published(setup) -> None:
    """Frames that arrived while the replica was down are kept on recovery only when the generation began after the
    running engine's (freshly scraped) process start; with no start time, or an earlier first frame, they go."""
    index, ingestor = setup
    ingestor.reset_replica("r", "down")
    ingestor.apply("r", 0, timed(160.0, stored([1, 2, 3, 4], None, TOKENS)))
    assert not ingestor.engine_recovered("r", 150.0) and held(index) == 16
    ingestor.reset_replica("r", "down")
    ingestor.apply("r", 5, timed(160.3, stored([1, 2, 3, 4], None, TOKENS)))  # within the new start time's margin
    assert ingestor.engine_recovered("r", 160.0) and held(index) == 0
    ingestor.reset_replica("r", "down")
    ingestor.apply("r", 9, timed(170.0, stored([1, 2, 3, 4], None, TOKENS)))
    assert ingestor.engine_recovered("r", None) and held(index) == 0  # no start time: in doubt, forgotten
    assert ingestor.stats.resets["recovered"] == 2


def test_a_generation_begun_after_the_start_was_reported_is_that_process_own(setup) -> None:
    """The restart was reported (a scrape) before the replica went down: from then on every frame older than the
    start is stale, so what the engine published while the replica was down is kept on recovery, even a frame
    within the clock margin (an engine that served a request as soon as it started)."""
    index, ingestor = setup
    ingestor.apply("r", 0, timed(100.0, stored([7, 8], None, TOKENS[:8])))
    assert ingestor.engine_started("r", 150.0)
    ingestor.reset_replica("r", "down")
    assert ingestor.apply("r", 3, timed(149.9, stored([5, 6], None, TOKENS[:8]))).status is ApplyStatus.STALE
    ingestor.apply("r", 0, timed(150.2, stored([1, 2, 3, 4], None, TOKENS)))
    assert not ingestor.engine_recovered("r", 150.0) and held(index) == 16


def test_a_restart_the_subscriber_found_in_a_replay_is_not_counted_again(setup) -> None:
    """restart_after_replay / replay_mismatch: the stream showed the restart before the scrape did."""
    index, ingestor = setup
    ingestor.apply("r", 0, timed(100.0, stored([1, 2, 3, 4], None, TOKENS)))
    ingestor.reset_replica("r", "restart_after_replay")
    generation = ingestor.generation("r")
    assert not ingestor.engine_started("r", 150.0)  # nothing applied since: the same restart
    ingestor.apply("r", 0, timed(150.2, stored([7, 8], None, TOKENS[:8])))
    assert not ingestor.engine_started("r", 150.0)
    assert held(index) == 8 and ingestor.generation("r") == generation and ingestor.stats.restarts == 0


def test_each_replica_counts_its_frames_by_fate_and_says_how_old_its_last_is() -> None:
    """What ``/admin/state`` shows of a replica's event streams: counts and sequence numbers, nothing of a frame."""
    now = [50.0]
    ingestor = EventIngestor(PrefixIndex(), clock=lambda: now[0])
    ingestor.add_replica("r", model="m")
    ingestor.add_replica("quiet", model="m")
    assert ingestor.stream_state("quiet", 8)["last_frame_age_s"] is None
    assert ingestor.stream_state("unknown", 8) is None
    ingestor.apply("r", 0, chain(tokens=TOKENS[:8]))
    ingestor.apply("r", 2, frame())  # a gap
    ingestor.apply("r", 1, frame(stored([9], 77, TOKENS[8:12])), source="replay")  # an orphan, replayed
    ingestor.apply("r", 2, frame(), source="replay")
    ingestor.apply("r", 2, frame())  # the live copy: a duplicate
    ingestor.apply("r", 3, b"\x00 not msgpack")  # malformed, keeps its place
    ingestor.purge("r")
    now[0] += 2.5
    state = ingestor.stream_state("r", 8)
    assert state is not None and state["last_frame_age_s"] == 2.5 and state["generation"] == ingestor.generation("r")
    assert state["counts"] == {"frames_applied": 3, "replayed": 2, "gaps": 1, "duplicates": 1, "stale": 0,
                               "malformed": 1, "orphans": 1, "purges": 1, "restarts": 0}
    assert state["streams_total"] == 1 and state["streams"] == [{"dp_rank": None, "last_seq": None, "gap": None}]
    ingestor.apply("r", 7, frame())
    ingestor.apply("r", 0, frame(), source="zmq")  # a step back on a live stream: the engine restarted
    state = ingestor.stream_state("r", 8)
    assert state["counts"]["restarts"] == 1 and state["streams"] == [{"dp_rank": None, "last_seq": 0, "gap": None}]
    for rank in range(1, 12):
        ingestor.apply("r", 0, frame(dp_rank=rank), dp_rank=rank)
    state = ingestor.stream_state("r", 8)
    assert state["streams_total"] == 12 and len(state["streams"]) == 8
