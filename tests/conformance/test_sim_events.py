"""The sim's KV-event stream is vLLM 0.33's: frames, msgpack shapes, block hashes (equal to the vectors' for the
same tokens), contiguous sequence numbers, replay framing with the end marker, and restart/drop faults."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgspec
import pytest
import zmq

from kvgate.loadgen.sim.wire import END_SEQ, BlockStored, KVEventBatch, encode_seq
from tests.support import Sim, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
TOKENS = list(range(1000, 1040))
DEADLINE_S = 5.0

Frame = tuple[bytes, int, bytes]


class Subscriber:
    """A SUB socket on one replica's publisher, read with deadlines."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def recv(self, timeout: float = DEADLINE_S) -> Frame | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def until(self, predicate: Any, timeout: float = DEADLINE_S) -> list[Frame]:
        """Frames up to and including the first whose decoded batch satisfies ``predicate``."""
        got: list[Frame] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frame = self.recv(max(0.0, deadline - time.monotonic()))
            if frame is None:
                break
            got.append(frame)
            if predicate(msgspec.msgpack.decode(frame[2], type=KVEventBatch)):
                return got
        raise AssertionError(f"no matching frame within {timeout}s; got {len(got)} frames")

    def close(self) -> None:
        self.sock.close(0)


def replay(ctx: zmq.Context, endpoint: str, start: int, timeout: float = DEADLINE_S) -> list[list[bytes]]:
    """Replies to one replay request from a DEALER, up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", encode_seq(start)])
        replies = []
        while True:
            assert dealer.poll(int(timeout * 1000)), "replay did not answer"
            reply = dealer.recv_multipart()
            replies.append(reply)
            if reply[2] == END_SEQ:
                return replies
    finally:
        dealer.close(0)


def post(sim: Sim, replica: int, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(sim.url(replica) + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def fault(sim: Sim, replica: int, **body: Any) -> None:
    assert httpx.post(sim.url(replica) + "/sim/fault", json=body, timeout=5).status_code == 200


def stored_tokens(tokens: list[int]) -> Any:
    return lambda batch: any(isinstance(e, BlockStored) and e.token_ids[:16] == tokens[:16] for e in batch.events)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim-events"), 1, "--time-scale", "0.01", "--topic", "kv-events")
    yield s
    s.stop()


@pytest.fixture
def sub(sim: Sim) -> Iterator[Subscriber]:
    """A subscriber known to be receiving: it pokes the replica (a prefix-cache reset and a one-block request) until
    a frame arrives, so every test starts from a cache holding only that block."""
    ctx = zmq.Context.instance()
    s = Subscriber(ctx, sim.events_endpoint(0))
    deadline = time.monotonic() + DEADLINE_S
    while s.recv(0.1) is None:
        assert time.monotonic() < deadline, "subscriber never joined"
        sim.reset_and_step(0)
    while s.recv(0.1) is not None:
        pass
    yield s
    s.close()


@pytest.fixture(scope="module")
def vector_frames(vectors_dir: Path) -> list[dict[str, Any]]:
    return json.loads((vectors_dir / "vllm-kv-events.json").read_text())["frames"]


def test_token_prompt_events_carry_vector_hashes(sim: Sim, sub: Subscriber, vector_frames: list[dict]) -> None:
    post(sim, 0, {"prompt": TOKENS})
    frames = sub.until(stored_tokens(TOKENS))
    topic, _, payload = frames[-1]
    assert topic == b"kv-events"
    generic = msgspec.msgpack.decode(payload)
    expected = vector_frames[0]["decoded"]
    assert isinstance(generic, list) and len(generic) == 3 and generic[2] == 0
    (event,) = [e for e in generic[1] if e["type"] == "BlockStored"]
    (want,) = expected[1]
    assert set(event) == set(want)
    assert event["block_hashes"] == want["block_hashes"] == [7322446309363477352, 17027874615116373601]
    assert event["parent_block_hash"] is None and event["token_ids"] == TOKENS[:32]
    assert (event["block_size"], event["medium"], event["lora_id"], event["lora_name"]) == (16, "GPU", None, None)


def test_salted_prompt_events(sim: Sim, sub: Subscriber, vector_frames: list[dict], vectors_dir: Path) -> None:
    post(sim, 0, {"prompt": TOKENS, "cache_salt": "tenant-a"})
    frames = sub.until(stored_tokens(TOKENS))
    (event,) = [e for e in msgspec.msgpack.decode(frames[-1][2])[1] if e["type"] == "BlockStored"]
    cases = json.loads((vectors_dir / "vllm-block-hashes.json").read_text())["cases"]
    want = next(c for c in cases if c["algo"] == "sha256" and c["cache_salt"] == "tenant-a"
                and c["none_hash_seed"] == "vllm-none-hash")
    assert event["block_hashes"] == want["block_hashes_int64"]
    assert event["extra_keys"] == [["tenant-a"], None]
    salted_vector_keys = set(vector_frames[1]["decoded"][1][0])
    assert set(event) == salted_vector_keys


def test_every_frame_decodes_and_seqs_are_contiguous(sim: Sim, sub: Subscriber) -> None:
    prompts = [[7000 + 50 * i + j for j in range(40)] for i in range(6)]
    for p in prompts:
        post(sim, 0, {"prompt": p})
    frames = sub.until(stored_tokens(prompts[-1]))
    seqs = [seq for _, seq, _ in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for _, _, payload in frames:
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        assert batch.data_parallel_rank == 0 and batch.events and batch.ts > 0


def test_replay_returns_missed_frames_then_end_marker(sim: Sim, sub: Subscriber) -> None:
    ctx = zmq.Context.instance()
    post(sim, 0, {"prompt": [8000 + j for j in range(40)]})
    live = sub.until(stored_tokens([8000 + j for j in range(40)]))
    fault(sim, 0, action="drop_events", fraction=1.0)
    missed = [5000 + j for j in range(40)]
    post(sim, 0, {"prompt": missed})
    assert sub.recv(0.3) is None, "dropped frames must not be sent"
    fault(sim, 0, action="drop_events", fraction=0.0)
    post(sim, 0, {"prompt": [5500 + j for j in range(40)]})
    after = sub.until(stored_tokens([5500 + j for j in range(40)]))
    gap_start, gap_end = live[-1][1] + 1, after[0][1]
    assert gap_end > gap_start, "dropped frames still consume sequence numbers"
    replies = replay(ctx, sim.replay_endpoint(0), gap_start)
    *data, end = replies
    assert end == [b"", b"", END_SEQ, b""]
    assert [int.from_bytes(r[2], "big") for r in data] == list(range(gap_start, after[-1][1] + 1))
    assert all(len(r) == 4 and r[0] == b"" and r[1] == b"kv-events" for r in data)
    replayed = [msgspec.msgpack.decode(r[3], type=KVEventBatch) for r in data]
    assert any(stored_tokens(missed)(b) for b in replayed)
    assert data[-1][3] == after[-1][2], "replayed payloads are the published bytes"


def test_replay_can_be_disabled(sim: Sim) -> None:
    ctx = zmq.Context.instance()
    fault(sim, 0, action="disable_replay")
    try:
        with pytest.raises(AssertionError, match="did not answer"):
            replay(ctx, sim.replay_endpoint(0), 0, timeout=0.3)
    finally:
        fault(sim, 0, action="enable_replay")
    assert replay(ctx, sim.replay_endpoint(0), 0)[-1][2] == END_SEQ


def test_reset_cache_emits_all_blocks_cleared_with_the_next_step(sim: Sim, sub: Subscriber) -> None:
    # As the real engine does: nothing at the reset itself; the next scheduler step's batch starts with it.
    fault(sim, 0, action="reset_cache")
    assert sub.recv(0.3) is None, "AllBlocksCleared waits for the engine's next step"
    post(sim, 0, {"prompt": TOKENS})
    frames = sub.until(lambda b: any(type(e).__name__ == "AllBlocksCleared" for e in b.events))
    events = msgspec.msgpack.decode(frames[-1][2])[1]
    assert events[0] == {"type": "AllBlocksCleared"}
    assert [e["type"] for e in events[1:]] == ["BlockStored"] and events[1]["token_ids"] == TOKENS[:32]


def test_restart_resets_sequence_and_replay_buffer(sim: Sim, sub: Subscriber) -> None:
    ctx = zmq.Context.instance()
    post(sim, 0, {"prompt": TOKENS})
    before = sub.until(stored_tokens(TOKENS))
    assert before[-1][1] > 0
    fault(sim, 0, action="restart")
    assert replay(ctx, sim.replay_endpoint(0), 0) == [[b"", b"", END_SEQ, b""]]
    body = post(sim, 0, {"prompt": TOKENS})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "a restart forgets the cache"
    after = sub.until(stored_tokens(TOKENS))
    assert after[0][1] == 0, "the first batch after a restart has seq 0"


def test_delayed_events_keep_order(sim: Sim, sub: Subscriber) -> None:
    fault(sim, 0, action="delay_events", ms=150)
    try:
        prompts = [[6000 + 50 * i + j for j in range(40)] for i in range(3)]
        start = time.monotonic()
        for p in prompts:
            post(sim, 0, {"prompt": p})
        first = sub.recv()
        assert first is not None and time.monotonic() - start >= 0.15
        frames = [first, *sub.until(stored_tokens(prompts[-1]))]
        seqs = [s for _, s, _ in frames]
        assert seqs == sorted(seqs)
    finally:
        fault(sim, 0, action="delay_events", ms=0)


def test_session_id_is_stamped_on_events(sim: Sim, sub: Subscriber) -> None:
    prompt = [6500 + j for j in range(40)]
    r = httpx.post(sim.url(0) + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                   headers={"X-Session-ID": "conv-7"}, timeout=5)
    assert r.status_code == 200
    frames = sub.until(stored_tokens(prompt))
    (event,) = [e for e in msgspec.msgpack.decode(frames[-1][2])[1] if e["type"] == "BlockStored"]
    assert event["session_id"] == "conv-7"
