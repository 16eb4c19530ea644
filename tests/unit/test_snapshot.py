"""A replica's index state taken over by another router: export, check and import (cache_index.snapshot)."""

from __future__ import annotations

import msgspec
import pytest

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.ingest import ApplyStatus, EventIngestor
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.match import Tier
from kvgate.cache_index.snapshot import (
    InvalidState, ReplicaState, StreamPoint, check_state, export_states, import_state,
)
from kvgate.loadgen.sim.wire import BlockRemoved
from tests.index_inspection import tiers_of
from tests.unit.test_ingest import BS, TOKENS, chain, frame, stored


def router() -> tuple[PrefixIndex, EventIngestor]:
    index = PrefixIndex()
    ingestor = EventIngestor(index)
    ingestor.add_replica("r", model="m")
    ingestor.add_replica("s", model="m")
    return index, ingestor


def held(index: PrefixIndex, replica: str, tokens: list[int] = TOKENS) -> tuple[int, int]:
    match = index.lookup(block_keys(namespace_key("m"), tokens, BS), BS).get(replica)
    return (0, 0) if match is None else (match.gpu, match.cpu)


def warm() -> tuple[PrefixIndex, EventIngestor]:
    index, ingestor = router()
    ingestor.apply("r", 7, chain(tokens=TOKENS[:8]), dp_rank=0)
    ingestor.apply("r", 8, frame(stored([3, 4], 2, TOKENS[8:16])), dp_rank=0)
    ingestor.apply("r", 9, frame(stored([1], None, TOKENS[:4], medium="CPU")), dp_rank=0)
    ingestor.apply("s", 0, frame(stored([20], None, TOKENS[:4]), dp_rank=1), dp_rank=1)
    return index, ingestor


def test_an_imported_state_credits_the_same_holdings_and_continues_the_stream() -> None:
    _, source = warm()
    states = msgspec.msgpack.decode(msgspec.msgpack.encode(export_states(source)), type=dict[str, ReplicaState])
    index, ingestor = router()
    for name, state in states.items():
        check_state(state)
        assert import_state(ingestor, name, state)
    assert held(index, "r") == (16, 0)
    assert held(index, "s", TOKENS[:4]) == (4, 0)
    first = block_keys(namespace_key("m"), TOKENS, BS)[0]
    assert tiers_of(index, "r", first) == [Tier.GPU, Tier.CPU]
    assert ingestor.expected_seq("r", 0) == 10 and ingestor.expected_seq("s", 1) == 1
    assert ingestor.block_size("r") == BS
    # the next frame resolves its parent and removals through the imported engine-hash map
    assert ingestor.apply("r", 10, frame(BlockRemoved([4], "GPU")), dp_rank=0).applied
    assert held(index, "r") == (12, 0)
    # a frame past the expected one is a gap (repaired by replay), one before it a restart
    assert ingestor.apply("r", 12, frame(), dp_rank=0).status is ApplyStatus.GAP
    assert ingestor.apply("s", 0, frame(), dp_rank=1).status is ApplyStatus.RESTARTED
    assert held(index, "s", TOKENS[:4]) == (0, 0)


def test_a_state_is_only_imported_into_a_fresh_replica_of_the_same_namespace() -> None:
    _, source = warm()
    state = export_states(source)["r"]
    index, ingestor = router()
    ingestor.apply("r", 0, chain(first_hash=30, tokens=TOKENS[:4]))
    assert not import_state(ingestor, "r", state)  # already fed by its own stream
    other = EventIngestor(PrefixIndex())
    other.add_replica("r", model="m", weight_version="v2")
    assert not import_state(other, "r", state)
    assert not import_state(other, "unknown", state)
    assert other.index.stats().entries == 0


def valid() -> ReplicaState:
    _, source = warm()
    return export_states(source)["r"]


@pytest.mark.parametrize("change", [
    {"keys": b"\x00" * 7},
    {"tiers": b"\x01"},
    {"tiers": b"\x00\x01\x01\x01\x01"},
    {"tiers": b"\x08\x01\x01\x01\x01"},
    {"engine_keys": b""},
    {"engine_keys": (123).to_bytes(8, "little") * 4},
    {"block_size": 0},
    {"first_ts": float("nan")},
    {"streams": [StreamPoint(0, 1), StreamPoint(0, 2)]},
    {"streams": [StreamPoint(-1, 1)]},
    {"streams": [StreamPoint(None, -1)]},
])
def test_an_inconsistent_state_is_rejected(change: dict) -> None:
    state = valid()
    check_state(state)
    fields = {f: getattr(state, f) for f in state.__struct_fields__} | change
    with pytest.raises(InvalidState):
        check_state(ReplicaState(**fields))


def test_a_key_listed_twice_is_rejected() -> None:
    state = valid()
    fields = {f: getattr(state, f) for f in state.__struct_fields__}
    fields["keys"] = state.keys[:8] * (len(state.tiers))
    with pytest.raises(InvalidState):
        check_state(ReplicaState(**fields))
