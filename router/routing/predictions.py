"""What a dispatch leaves behind for the requests after it: the prompt's blocks predicted on the replica it went to
(so a burst of siblings does not all miss before the first ``BlockStored`` arrives), and its session's replica.

Predictions are told to ``on_predicted`` too (peer gateways' routing hints, :mod:`kvgate.router.peers.hints`). An
answer that reused less than was predicted refutes the rest: a chain the engine holds but kvgate cannot confirm (its
stores were forgotten, so later ones are orphans) is otherwise predicted again by every dispatch while the engine
evicts its tail between requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvgate.cache_index.index import PrefixIndex
from kvgate.router.routing.records import Routed
from kvgate.router.routing.sessions import SessionMemory


class Predictions:
    def __init__(self, index: PrefixIndex, sessions: SessionMemory) -> None:
        self.index = index
        self.sessions = sessions
        self.on_predicted: Callable[[str, Sequence[int]], None] | None = None
        """Told every prediction this gateway makes (the routing hints its peers receive)."""

    def dispatched(self, routed: Routed, replica: str) -> bool:
        """The request is on its way to ``replica``: predict its blocks there and remember the session's replica.
        Whether the prompt had blocks to predict (a prefix whose heat counts)."""
        predicted = self.predict(routed, replica)
        session_id = routed.request.session_id
        if session_id:
            self.sessions.remember(routed.request.tenant, routed.cache_salt, session_id, replica)
        return predicted

    def predict(self, routed: Routed, replica: str) -> bool:
        """``replica`` is computing the prompt (serving it, or prefilling it for another replica): its blocks are
        predicted there (and shared with the peers). Whether the prompt had blocks to predict."""
        keys = routed.keys_for(replica)
        if keys:
            self.index.touch(replica, keys)
            self.index.predict(replica, keys)
            if self.on_predicted is not None:
                self.on_predicted(replica, keys)
        return bool(keys)

    def refuted(self, routed: Routed, replica: str, reused_tokens: int) -> None:
        """``replica`` answered having reused ``reused_tokens`` of the prompt: its blocks past those are not
        predicted there any more (a prediction of them, this request's own included, would credit the next request
        with blocks the engine has just shown it can lose)."""
        keys = routed.keys_for(replica)
        if not keys or routed.matched_tokens(replica) <= reused_tokens:
            return
        block_size = routed.block_sizes.get(replica, routed.request.block_size)
        self.index.unpredict(replica, keys[reused_tokens // block_size:])
