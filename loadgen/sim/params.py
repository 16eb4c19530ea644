"""The knobs of a simulated replica: cache geometry, the time model (all durations in unscaled milliseconds), and
whether its Responses API keeps responses."""

from __future__ import annotations

from dataclasses import dataclass

KV_BYTES_PER_TOKEN = 320 * 1024
"""The KV size per token of docs/benchmarks.md's simulated fleet; sizes CPU loads and NIXL transfers."""

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class SimParams:
    model: str
    block_size: int = 16
    kv_blocks: int = 4096
    cpu_blocks: int = 0
    max_model_len: int = 65536
    time_scale: float = 1.0
    """Multiplies every simulated duration; 0 runs steps back to back (ordering stays true)."""
    step_overhead_ms: float = 6.0
    prefill_ms_per_token: float = 0.035
    request_overhead_ms: float = 20.0
    """Fixed prefill cost per request (0.035 ms/token + 20 ms/request by default)."""
    decode_ms_per_seq: float = 0.06
    """With the step overhead, a decode step of 64 running sequences costs ~10 ms, of 256 ~21 ms (short contexts)."""
    decode_ms_per_context_token: float = 0.00002
    """Attention: a decode step reads every decoding sequence's KV once, 320 KiB/token at ~16 TB/s (the aggregate HBM
    a replica with these prefill constants has), so 64 sequences at 8k tokens of context add ~10 ms to the step."""
    token_budget: int = 8192
    """Tokens scheduled per step (vLLM's max_num_batched_tokens); long prompts are prefilled in chunks."""
    max_num_seqs: int = 256
    cpu_load_gib_s: float = 20.0
    transfer_setup_ms: float = 12.0
    transfer_gib_s: float = 22.0
    transfer_lease_s: float = 30.0
    """Wall-clock seconds a prefill-only request's blocks stay held for a remote decode (a timeout, never scaled)."""
    replay_buffer_steps: int = 10000
    topic: str = ""
    seed: int = 0
    responses_store: bool = False
    """Keep Responses API responses for ``previous_response_id`` and ``GET /v1/responses/{id}`` (vLLM's
    ``VLLM_ENABLE_RESPONSES_API_STORE``, which ``kvgate sim`` reads)."""

    def cpu_load_ms(self, tokens: int) -> float:
        return tokens * KV_BYTES_PER_TOKEN / (self.cpu_load_gib_s * GIB) * 1000.0

    def transfer_ms(self, tokens: int) -> float:
        return self.transfer_setup_ms + tokens * KV_BYTES_PER_TOKEN / (self.transfer_gib_s * GIB) * 1000.0
