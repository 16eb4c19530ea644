"""The scheduler of one simulated replica: vLLM-style continuous batching over the paged prefix cache.

Each step schedules the running requests in order (a decode token each, or their next prefill chunk), then admits
waiting requests FCFS while the token budget, ``max_num_seqs`` and free blocks allow. A step costs ``overhead +
prefill_ms_per_token x computed tokens + request_overhead x requests starting prefill + decode_ms_per_seq x decoding
requests + decode_ms_per_context_token x the context those requests attend over`` (unscaled ms); the loop sleeps that
long times ``time_scale`` and then applies the step. So a request's TTFT is its queue wait plus the prefill of its
*uncached* tokens, measured on a model clock that does not depend on the scale, and a decode step grows with the
sequences running and their context. Every request in a step waits for the whole step: a prefill chunk on a replica
that also decodes stalls those decodes by the chunk's time (vLLM's chunked prefill), which is what prefill/decode
disaggregation avoids. A request whose prompt was pulled from a prefill replica pays no per-request prefill overhead
(that replica paid it); its few remaining prompt tokens join a step like decode tokens.
Every generated token is stamped with the engine clock, so the gaps between them are the inter-token latency.
Blocks found on the CPU tier or pulled from a peer's lease (NixlConnector) are usable once their load time has
passed on that clock; they are announced (``BlockStored``) then.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .block_hash import BlockKey, next_block
from .kv_cache import Allocation, BlockPool
from .params import SimParams
from .wire import AllBlocksCleared

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Where a ``do_remote_prefill`` request pulls its prefix from (the prefill replica's response, as sent back)."""

    engine_id: str
    request_id: str


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    chain: list[BlockKey]
    """The prompt's full blocks; dropped when the request ends (records outlive requests, chains can be MBs)."""
    text_seed: int = 0
    """Picks the generated tokens: the same prompt always gets the same completion."""
    cache_salt: str | None = None
    session_id: str | None = None
    """vLLM 0.33's session id (body ``session_id``, else header X-Session-ID, else ``vllm_xargs.session_id``)."""
    tail_tokens: list[int] = field(default_factory=list)
    """Tokens after the last full block whose KV is computed: prompt tail, then generated tokens. When they fill a
    block it is cached like a prompt block (vLLM caches generated blocks too; multi-turn chats hit them)."""
    prefill_only: bool = False
    remote: RemoteSource | None = None
    streaming: bool = False
    """Wake the waiting handler on every token (SSE); otherwise only when the request ends."""
    info: dict[str, Any] = field(default_factory=dict)
    """Request facts only /sim/requests reports (endpoint, model, stream, cache_salt, headers, ...)."""
    state: State = State.WAITING
    abort_reason: str | None = None
    num_computed: int = 0
    committed_blocks: int = 0
    offloaded_blocks: int = 0
    """The prompt's leading blocks written to the CPU tier (or skipped: loaded from it) since its last admission."""
    prefill_started: bool = False
    prompt_tail: list[int] = field(default_factory=list)
    """The prompt's tokens after its last full block, kept to compute them again after a preemption."""
    preempted: bool = False
    """Moved back to the waiting queue by a prefix-cache reset that preempted the running requests."""
    alloc: Allocation = field(default_factory=Allocation)
    pending_load: list[BlockKey] = field(default_factory=list)
    ready_at_ms: float = 0.0
    load_ms: float = 0.0
    """Of its last admission, the time its cached tiers' blocks (and a pulled KV) took to load before its prefill."""
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    transferred_tokens: int = 0
    transfer_status: str | None = None
    arrival_clock_ms: float = 0.0
    scheduled_clock_ms: float | None = None
    first_token_clock_ms: float | None = None
    arrival_wall: float = field(default_factory=time.monotonic)
    first_token_wall: float | None = None
    token_clock_ms: list[float] = field(default_factory=list)
    """The engine clock when each generated token was sampled (the first is ``first_token_clock_ms``)."""
    kv_transfer_params_out: dict[str, Any] | None = None
    last_key: BlockKey | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.state in (State.COMPLETED, State.ABORTED)


@dataclass(slots=True)
class Lease:
    """Blocks of a finished prefill-only request held for a remote decode to pull."""

    alloc: Allocation
    hashes: frozenset[bytes]
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class Step:
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)
    prefill_tokens: int = 0
    new_prefills: int = 0
    context_tokens: int = 0
    """Tokens of KV the step's decodes attend over."""

    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests_submitted: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_cached: int = 0
    """Prompt tokens not computed: local hits (GPU, CPU tier) plus those pulled from a peer."""
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    cpu_loaded_tokens: int = 0
    transfers_in: int = 0
    transfers_fallback: int = 0
    leases_granted: int = 0
    leases_pulled: int = 0
    leases_expired: int = 0
    first_legs_served: int = 0
    """Prefill-only requests (vLLM's ``do_remote_decode`` first leg, SGLang's prefill leg) that finished and left
    their KV for a remote decode."""
    off_role_requests: int = 0
    """Requests the replica's role says it should not get, served anyway (a whole request on a prefill replica,
    a first leg on a decode replica), as vLLM's ``kv_both`` serves them."""
    restarts: int = 0


ITL_GAPS_KEPT = 100_000


@dataclass(slots=True)
class ItlStats:
    """Inter-token latency on the engine clock over the replica's life: every gap counted, the last
    ``ITL_GAPS_KEPT`` kept for percentiles."""

    count: int = 0
    total_ms: float = 0.0
    max_ms: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=ITL_GAPS_KEPT))

    def add(self, gap_ms: float) -> None:
        self.count += 1
        self.total_ms += gap_ms
        self.max_ms = max(self.max_ms, gap_ms)
        self.recent.append(gap_ms)

    def summary(self) -> dict[str, float | int | None]:
        kept = sorted(self.recent)
        p99 = kept[min(len(kept) - 1, int(0.99 * len(kept)))] if kept else None
        return {"count": self.count, "mean_ms": self.total_ms / self.count if self.count else None,
                "p99_ms": p99, "max_ms": self.max_ms if self.count else None}


class Engine:
    def __init__(
        self,
        params: SimParams,
        publish: Callable[[list], None],
        output_vocab: Sequence[int],
        peers: dict[str, "Engine"],
        side_channel_port: int,
    ) -> None:
        self.params = params
        self.side_channel_port = side_channel_port
        self.publish = publish
        self.output_vocab = output_vocab
        self.peers = peers
        self.pool = BlockPool(params.kv_blocks, params.block_size, params.cpu_blocks)
        self.engine_id = self._new_engine_id()
        peers[self.engine_id] = self
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.leases: dict[str, Lease] = {}
        self.clock_ms = 0.0
        self.stats = EngineStats()
        self.itl = ItlStats()
        self._wakeup = asyncio.Event()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._stall_deadline: float | None = None

    # --- requests ------------------------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        req.last_key = req.chain[-1] if req.chain else None
        req.prompt_tail = list(req.tail_tokens)
        req.arrival_clock_ms = self.clock_ms
        self.stats.requests_submitted += 1
        self.stats.prompt_tokens += req.prompt_len
        self.waiting.append(req)
        self._wakeup.set()

    def abort(self, req: SimRequest, reason: str) -> None:
        """Stop a request at once and free its blocks (client gone, or the replica faulted)."""
        if req.finished:
            return
        if req.state is State.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.pool.release(req.alloc)
        req.state = State.ABORTED
        req.abort_reason = reason
        req.chain = []
        self.stats.requests_aborted += 1
        req.changed.set()
        self._wakeup.set()

    # --- faults --------------------------------------------------------------------------------------------------
    def restart(self) -> None:
        """An engine restart: every request aborted, cache gone without an event, a new NIXL engine id."""
        for req in [*self.waiting, *self.running]:
            req.state = State.ABORTED
            req.abort_reason = "restart"
            req.chain = []
            self.stats.requests_aborted += 1
            req.changed.set()
        self.waiting.clear()
        self.running = []
        for lease in self.leases.values():
            if lease.timer is not None:
                lease.timer.cancel()
        self.leases.clear()
        self.pool = BlockPool(self.params.kv_blocks, self.params.block_size, self.params.cpu_blocks)
        self.peers.pop(self.engine_id, None)
        self.engine_id = self._new_engine_id()
        self.peers[self.engine_id] = self
        self.stats.restarts += 1
        self._wakeup.set()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: refused (False, nothing forgotten) while any
        block is in use, unless ``reset_running_requests`` first preempts every running request back to the front
        of the waiting queue (their blocks freed, their prompts computed again). Blocks leased to a remote decode
        keep it refused. The ``AllBlocksCleared`` is only queued: it goes out with the engine's next scheduler step,
        in the same batch as that step's ``BlockStored`` (none while the engine idles)."""
        if reset_running_requests:
            for req in reversed(self.running):
                self._preempt(req)
            self.running = []
        if self.pool.in_use():
            return False
        self.pool.reset()
        return True

    def _preempt(self, req: SimRequest) -> None:
        """Back to the front of the waiting queue with nothing computed (vLLM's recompute preemption); the
        ``cached_tokens`` it reports stay those of its first admission, as vLLM's ``num_cached_tokens``."""
        self.pool.release(req.alloc)
        req.state = State.WAITING
        req.num_computed = 0
        req.committed_blocks = 0
        req.offloaded_blocks = 0
        req.prefill_started = False
        req.pending_load = []
        req.ready_at_ms = 0.0
        req.last_key = req.chain[-1] if req.chain else None
        req.tail_tokens = req.prompt_tail + req.output[:-1]  # recomputed with the prompt; the last one is sampled
        req.preempted = True
        self.waiting.appendleft(req)
        self._wakeup.set()

    def stall(self, seconds: float | None) -> None:
        self._stall_deadline = math.inf if seconds is None else time.monotonic() + seconds
        self._unstalled.clear()

    def unstall(self) -> None:
        self._stall_deadline = None
        self._unstalled.set()

    @property
    def stalled(self) -> bool:
        return self._stall_deadline is not None

    # --- NIXL leases (source side) -------------------------------------------------------------------------------
    def lease_hashes(self, request_id: str) -> frozenset[bytes] | None:
        lease = self.leases.get(request_id)
        return lease.hashes if lease else None

    def release_lease(self, request_id: str, expired: bool = False) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return
        if lease.timer is not None:
            lease.timer.cancel()
        self.pool.release(lease.alloc)
        if expired:
            self.stats.leases_expired += 1
        else:
            self.stats.leases_pulled += 1
        self._wakeup.set()

    # --- the loop ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler loop. A bug in a step must not kill the replica: it is logged and the engine restarts."""
        while True:
            try:
                await self._loop()
            except Exception:
                log.exception("engine step failed; restarting the engine")
                self.restart()
                self.publish([AllBlocksCleared()])  # subscribers must forget what this engine held

    async def _loop(self) -> None:
        while True:
            if self._stall_deadline is not None:
                await self._wait_unstalled()
                continue
            if not self.waiting and not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step = self._schedule()
            if step.empty():
                wait_ms = self._next_ready_ms()
                if wait_ms is None:  # blocked on memory held by leases: wait for a release or a new request
                    self._flush_events()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await self._sleep(wait_ms)
                self.clock_ms += wait_ms
                self._flush_events()
                continue
            p = self.params
            cost_ms = (
                p.step_overhead_ms
                + p.prefill_ms_per_token * step.prefill_tokens
                + p.request_overhead_ms * step.new_prefills
                + p.decode_ms_per_seq * len(step.decode)
                + p.decode_ms_per_context_token * step.context_tokens
            )
            await self._sleep(cost_ms)
            self.clock_ms += cost_ms
            self.stats.steps += 1
            self._apply(step)
            self._flush_events()

    async def _sleep(self, ms: float) -> None:
        await asyncio.sleep(ms * self.params.time_scale / 1000.0)

    async def _wait_unstalled(self) -> None:
        assert self._stall_deadline is not None
        remaining = self._stall_deadline - time.monotonic()
        if remaining <= 0:
            self.unstall()
            return
        try:
            await asyncio.wait_for(self._unstalled.wait(), None if math.isinf(remaining) else remaining)
        except asyncio.TimeoutError:
            self.unstall()

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events:
            self.publish(events)

    def _next_ready_ms(self) -> float | None:
        pending = [r.ready_at_ms for r in self.running if r.ready_at_ms > self.clock_ms]
        return min(pending) - self.clock_ms if pending else None

    # --- scheduling ----------------------------------------------------------------------------------------------
    def _schedule(self) -> Step:
        step = Step()
        budget = self.params.token_budget
        for req in self.running:
            if budget == 0:
                break
            budget = self._plan(req, budget, step)
        while self.waiting and budget > 0 and len(self.running) < self.params.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget = self._plan(req, budget, step)
        return step

    def _plan(self, req: SimRequest, budget: int, step: Step) -> int:
        if req.ready_at_ms > self.clock_ms:
            return budget
        if req.pending_load:
            self._finish_load(req)
        remaining = req.prompt_len - req.num_computed
        if remaining > 0:
            n = min(remaining, budget)
            self._cache_scheduled(req, req.num_computed + n)
            step.prefill.append((req, n))
            step.prefill_tokens += n
            if not req.prefill_started:
                req.prefill_started = True
                step.new_prefills += 0 if req.transferred_tokens else 1
            return budget - n
        step.decode.append(req)
        step.context_tokens += req.prompt_len + len(req.output)
        return budget - 1

    def _cache_scheduled(self, req: SimRequest, tokens: int) -> None:
        """Cache (and announce) the prompt's full blocks within the first ``tokens`` when they are scheduled, not
        when computed: vLLM's ``allocate_slots`` registers their hashes at once, so a request scheduled after this
        one, in this step or a later one, reuses them while they are still being computed."""
        full = min(tokens // self.params.block_size, len(req.chain))
        if full > req.committed_blocks:
            self.pool.commit(req.alloc, req.chain[req.committed_blocks : full], req.session_id)
            req.committed_blocks = full

    def _admit(self, req: SimRequest) -> bool:
        """Find the request's prefix (GPU, peer lease, CPU), pin and reserve its blocks; False if they do not fit."""
        pool, bs = self.pool, self.params.block_size
        max_hit_blocks = min((req.prompt_len - 1) // bs, len(req.chain))  # the last prompt token is always computed
        lease_hashes = self._remote_lease(req)
        gpu_keys: list[BlockKey] = []
        transfer_keys: list[BlockKey] = []
        cpu_keys: list[BlockKey] = []
        for key in req.chain[:max_hit_blocks]:
            h = key.block_hash
            if h in pool.gpu:
                gpu_keys.append(key)
            elif lease_hashes is not None and h in lease_hashes:
                transfer_keys.append(key)
            elif h in pool.cpu:
                cpu_keys.append(key)
            else:
                break
        total_blocks = -(-(req.prompt_len + req.max_tokens) // bs)
        private = total_blocks - len(gpu_keys)
        evictable_hits = sum(1 for k in gpu_keys if pool.gpu[k.block_hash].ref_count == 0)
        if private > pool.available() - evictable_hits:
            return False
        pool.pin(req.alloc, gpu_keys)
        pool.touch_cpu(cpu_keys)
        pool.allocate(req.alloc, private)
        hit_blocks = len(gpu_keys) + len(transfer_keys) + len(cpu_keys)
        if not req.preempted:  # readmitted after a preemption, it reports its first admission's hits
            req.cached_tokens = (len(gpu_keys) + len(cpu_keys)) * bs
        req.transferred_tokens = len(transfer_keys) * bs
        req.num_computed = hit_blocks * bs
        req.committed_blocks = hit_blocks
        # vLLM's offloading connector stores the prefix hits too, unless the request loads from the tier.
        req.offloaded_blocks = hit_blocks if cpu_keys else 0
        req.pending_load = transfer_keys + cpu_keys
        load_ms = self.params.cpu_load_ms(len(cpu_keys) * bs)
        if transfer_keys:
            load_ms += self.params.transfer_ms(req.transferred_tokens)
            req.transfer_status = "pulled"
            self.stats.transfers_in += 1
        elif req.remote is not None:
            req.transfer_status = "fallback"
            self.stats.transfers_fallback += 1
        req.load_ms = load_ms
        req.ready_at_ms = self.clock_ms + load_ms
        req.scheduled_clock_ms = self.clock_ms
        req.state = State.RUNNING
        s = self.stats
        s.prefix_cache_queries += req.prompt_len
        s.prefix_cache_hits += req.cached_tokens
        s.prompt_tokens_cached += req.cached_tokens + req.transferred_tokens
        s.cpu_loaded_tokens += len(cpu_keys) * bs
        if req.remote is not None:
            s.external_prefix_cache_queries += req.prompt_len
            s.external_prefix_cache_hits += req.transferred_tokens
        return True

    def _remote_lease(self, req: SimRequest) -> frozenset[bytes] | None:
        if req.remote is None:
            return None
        source = self.peers.get(req.remote.engine_id)
        if source is None or source is self:
            return None
        return source.lease_hashes(req.remote.request_id)

    def _finish_load(self, req: SimRequest) -> None:
        """Loaded (CPU) or pulled (peer) blocks are now on this GPU: cache and announce them."""
        self.pool.commit(req.alloc, req.pending_load, req.session_id)
        req.pending_load = []
        if req.remote is not None and req.transferred_tokens:
            source = self.peers.get(req.remote.engine_id)
            if source is not None:
                source.release_lease(req.remote.request_id)

    # --- applying a step -----------------------------------------------------------------------------------------
    def _apply(self, step: Step) -> None:
        for req, n in step.prefill:
            if req.state is not State.RUNNING:
                continue
            req.num_computed += n
            self.stats.prefill_tokens_computed += n
            self._offload_computed(req)
            if req.num_computed == req.prompt_len:
                req.first_token_clock_ms = self.clock_ms
                req.first_token_wall = time.monotonic()
                self._emit_token(req)
        for req in step.decode:
            if req.state is State.RUNNING:
                self._emit_token(req)
        if any(r.state is not State.RUNNING for r in self.running):
            self.running = [r for r in self.running if r.state is State.RUNNING]

    def _offload_computed(self, req: SimRequest) -> None:
        """The prompt's blocks this step computed go to the CPU tier as the step ends, as vLLM's offloading connector
        stores each step's newly computed blocks."""
        if not self.pool.cpu_capacity:
            return
        full = min(req.num_computed // self.params.block_size, len(req.chain))
        if full > req.offloaded_blocks:
            self.pool.offload(req.chain[req.offloaded_blocks : full])
            req.offloaded_blocks = full

    def _emit_token(self, req: SimRequest) -> None:
        vocab = self.output_vocab
        if req.output:  # this step computed the KV of the previously sampled token
            self._extend_cache(req, req.output[-1])
        req.output.append(vocab[(req.text_seed + self.params.seed + 7 * len(req.output)) % len(vocab)])
        if req.token_clock_ms:
            self.itl.add(self.clock_ms - req.token_clock_ms[-1])
        req.token_clock_ms.append(self.clock_ms)
        self.stats.generation_tokens += 1
        if len(req.output) >= req.max_tokens:
            self._finish(req)
            req.changed.set()
        elif req.streaming:
            req.changed.set()

    def _extend_cache(self, req: SimRequest, token: int) -> None:
        req.tail_tokens.append(token)
        bs = self.params.block_size
        while len(req.tail_tokens) >= bs:  # more than one block only after a preemption recomputed the output
            key = next_block(req.last_key, req.tail_tokens[:bs], req.cache_salt)
            self.pool.commit(req.alloc, [key], req.session_id)
            self.pool.offload([key])
            req.last_key = key
            req.tail_tokens = req.tail_tokens[bs:]

    def _finish(self, req: SimRequest) -> None:
        req.state = State.COMPLETED
        req.chain = []
        self.stats.requests_completed += 1
        if req.prefill_only:
            self.stats.first_legs_served += 1
            self._grant_lease(req)
        else:
            self.pool.release(req.alloc)

    def _grant_lease(self, req: SimRequest) -> None:
        """Keep a prefill-only request's cached blocks pinned for a remote decode (NixlConnector's P side)."""
        self.pool.free_slots += req.alloc.private_slots
        req.alloc.private_slots = 0
        lease = Lease(req.alloc, frozenset(b.key.block_hash for b in req.alloc.pinned))
        lease.timer = asyncio.get_running_loop().call_later(
            self.params.transfer_lease_s, self.release_lease, req.request_id, True
        )
        self.leases[req.request_id] = lease
        self.stats.leases_granted += 1
        req.kv_transfer_params_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in req.alloc.pinned]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": req.prompt_len,
        }

    @staticmethod
    def _new_engine_id() -> str:
        return str(uuid.uuid4())
