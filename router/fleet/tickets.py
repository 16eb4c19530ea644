"""What one gateway has put on a replica: a dispatched request's load ticket, released exactly once, and the summary
of a gateway's dispatched work that peer gateways exchange (:mod:`kvgate.router.fleet.peer_work`)."""

from __future__ import annotations

import time
from typing import NamedTuple

from kvgate.router.fleet.replica import Replica


class DispatchedWork(NamedTuple):
    """What one gateway has sent one replica: uncached prompt tokens and requests still prefilling, and its recent
    dispatch rate (``Replica.arrivals``). Peer gateways exchange these (:mod:`kvgate.router.fleet.peer_work`)."""

    prefill_tokens: int = 0
    prefilling: int = 0
    arrival_rate_per_s: float = 0.0


NO_WORK = DispatchedWork()


class LoadTicket:
    """The load one dispatched request puts on its replica, released exactly once."""

    __slots__ = ("replica", "caller", "_prefill_tokens", "_prefilling", "_finished", "_epoch")

    def __init__(self, replica: Replica, prefill_tokens: int, caller: str | None = None) -> None:
        self.replica = replica
        self.caller = caller
        """Whose request it is (the tenant, None without tenants): the breaker counts failures by caller."""
        self._prefill_tokens = prefill_tokens
        self._prefilling = True
        self._finished = False
        replica.in_flight += 1
        replica.in_flight_prefill_tokens += prefill_tokens
        replica.in_flight_prefilling += 1
        self._epoch = epoch = replica.scrape_epoch
        by_epoch = replica.prefilling_by_epoch
        by_epoch[epoch] = by_epoch.get(epoch, 0) + 1
        replica.breaker.on_dispatch(caller)

    def first_token(self) -> None:
        """The prefill is done: the request and its tokens no longer wait on the replica. Idempotent."""
        if not self._prefilling:
            return
        self._prefilling = False
        replica = self.replica
        replica.in_flight_prefill_tokens -= self._prefill_tokens
        replica.in_flight_prefilling -= 1
        self._prefill_tokens = 0
        by_epoch = replica.prefilling_by_epoch
        left = by_epoch[self._epoch] - 1
        if left:
            by_epoch[self._epoch] = left
        else:
            del by_epoch[self._epoch]

    def finish(self, ok: bool | None) -> None:
        """The request is over. ``ok``: True, the replica served it; False, a failure blamed on the replica (it
        counts toward opening the breaker); None, it proves neither (the engine refused what the client sent, or a
        failure not yet blamed on the replica, see :meth:`blame`). Idempotent: only the first call counts."""
        if self._finished:
            return
        self._finished = True
        self.first_token()
        self.replica.in_flight -= 1
        self.replica.completed += 1
        breaker = self.replica.breaker
        if ok:
            self.replica.progressed_at = time.monotonic()
            breaker.record_success()
        elif ok is None:
            breaker.record_inconclusive()
        else:
            breaker.record_failure(self.caller)

    def blame(self) -> None:
        """A failure this ticket ended with unblamed (``finish(None)``) turned out to be the replica's: the same
        request succeeded on another replica."""
        self.replica.breaker.record_failure(self.caller)
