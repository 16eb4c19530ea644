"""What a real vLLM replica holds in its prefix cache, rebuilt from its own replay buffer.

Independent of kvgate on purpose: the replay socket is read with plain pyzmq and the batches decoded as generic
msgpack (events are maps since vLLM 0.24), so a mistake in kvgate's decoding or index cannot hide here. The state is
the set of blocks the engine stored and has not removed since its last ``AllBlocksCleared``, each known by its
engine hash, its parent's hash and its tokens; a prompt's cached prefix is the chain of held blocks from the root that
spells the prompt's first tokens, the same walk the engine's own lookup makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import zmq

END_OF_REPLAY = -1


@dataclass
class EngineState:
    block_size: int | None = None
    held: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    """engine block hash -> (parent block hash, the block's tokens)."""
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    first_seq: int | None = None
    last_seq: int = -1

    def apply(self, seq: int, events: list[dict]) -> None:
        if self.first_seq is None:
            self.first_seq = seq
        self.last_seq = seq
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                size = event["block_size"]
                self.block_size = size
                parent = event["parent_block_hash"]
                tokens = event["token_ids"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    self.held[block_hash] = (parent, tuple(tokens[i * size:(i + 1) * size]))
                    parent = block_hash
                    self.stored += 1
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    if self.held.pop(block_hash, None) is not None:
                        self.removed += 1
            elif kind == "AllBlocksCleared":
                self.held.clear()
                self.cleared += 1

    def cached_blocks(self, token_ids: list[int]) -> int:
        """Leading full blocks of ``token_ids`` the engine holds as one chain from the root."""
        if self.block_size is None:
            return 0
        children = {(parent, tokens): block_hash for block_hash, (parent, tokens) in self.held.items()}
        size, parent, count = self.block_size, None, 0
        while (count + 1) * size <= len(token_ids):
            block_hash = children.get((parent, tuple(token_ids[count * size:(count + 1) * size])))
            if block_hash is None:
                break
            parent, count = block_hash, count + 1
        return count

    def reusable_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens the engine would serve from cache: held blocks, but never the prompt's last token's block
        (the engine always computes the last token, so a prompt that is an exact multiple of the block size
        reuses one block less than it holds)."""
        if self.block_size is None:
            return 0
        return min(self.cached_blocks(token_ids), (len(token_ids) - 1) // self.block_size) * self.block_size


def replay_state(endpoint: str, timeout_s: float = 10.0) -> EngineState:
    """Ask the replay ROUTER for everything from sequence 0 and fold it into an :class:`EngineState`."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        state = EngineState()
        while True:
            frames = sock.recv_multipart()  # [b"", topic, seq, payload]; seq -1 ends the replay
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_OF_REPLAY:
                return state
            _ts, events, *_ = msgspec.msgpack.decode(frames[-1])
            state.apply(seq, events)
    finally:
        sock.close()
