"""The copies a router made, and what each saved or cost the requests after it.

A router that sends a request away from the replica holding its prefix has the prefix recomputed elsewhere: a *copy*.
It pays a longer prefill now, and buys a second holder, which pays back only if later requests of that prefix hit
on it. Hot-prefix replication makes copies on purpose (warm-ups); a cost policy makes them when the holder's queue
looks longer than the recompute. Both are bets, and this audit settles them after the run.

It replays a run's requests in the order they started, on the replica each was served by, and keeps for every
replica the prefix chains it was sent (``Request.chain``: one node per full 16-token block, equal nodes meaning equal
prefixes). A replica is taken to hold what it was sent, as if it never evicted: the engine's reported cached tokens
say what it really reused. For each request:

* the tokens it recomputed although another replica had been sent them are its *copy tokens* (a *copy* when they
  are at least ``min_tokens``); priced with :class:`IdealPrefill`, the prefill it paid for them;
* each block it reused (the engine's cached tokens) is credited to how that block reached the replica: first sent
  there, copied there by an earlier request, or never sent there at all (a warm-up put it there).

So ``copy_saved_ms`` (the prefill later requests skipped on blocks that copies brought) against ``copy_cost_ms``
says whether a run's copies paid; ``warmup_saved_ms`` is the same for warm-ups, whose own cost the engines pay
outside any request. What a copy gained by avoiding the holder's queue shows in the TTFT, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.workloads.oracle import ORACLE_BLOCK_SIZE, IdealPrefill
from kvgate.loadgen.workloads.request import Request

MIN_COPY_TOKENS = 512
"""The least recomputation of a held prefix counted as a copy: a few blocks of a shared system prompt recomputed
alongside a cold document are not a placement decision."""

COPY_FIELDS = ("copies", "copy_tokens", "copy_cost_ms", "copy_saved_tokens", "copy_saved_ms", "warmup_saved_tokens",
               "warmup_saved_ms")


def copies_audit(
    records: Sequence[RequestRecord], requests: Sequence[Request], ideal: IdealPrefill = IdealPrefill(),
    min_tokens: int = MIN_COPY_TOKENS,
) -> dict[str, Any]:
    """The run's copies and what they saved or cost (the module docstring); empty when the workload carries no
    chains or no request names its replica."""
    by_index = {r.index: r for r in requests}
    served = sorted((r for r in records if r.ok and r.replica and r.index in by_index and by_index[r.index].chain),
                    key=lambda r: r.start_s)
    if not served:
        return {}
    bs = ORACLE_BLOCK_SIZE
    came_by: dict[str, dict[int, str]] = {}
    """Per replica, how each block it holds got there: ``first`` (no other replica had it), ``copy`` or ``warmup``."""
    holders: dict[int, int] = {}
    """How many replicas hold each block."""
    out = dict.fromkeys(COPY_FIELDS, 0.0)
    for record in served:
        chain = by_index[record.index].chain
        prompt = record.prompt_tokens or record.expected_prompt_tokens
        here = came_by.setdefault(record.replica or "", {})
        reused = min((record.cached_tokens or 0) // bs, len(chain))
        for node in chain[:reused]:
            if node not in here:  # reused, yet never sent here: a warm-up brought it
                here[node] = "warmup"
                holders[node] = holders.get(node, 0) + 1
        for origin in ("copy", "warmup"):
            brought = sum(1 for node in chain[:reused] if here[node] == origin)
            if brought:
                out[f"{origin}_saved_tokens"] += brought * bs
                out[f"{origin}_saved_ms"] += (ideal.ttft_ms(prompt, (reused - brought) * bs)
                                              - ideal.ttft_ms(prompt, reused * bs))
        held_elsewhere = 0
        for node in chain:
            if holders.get(node, 0) - (node in here) <= 0:
                break
            held_elsewhere += 1
        recomputed = max(held_elsewhere - reused, 0)
        is_copy = recomputed * bs >= min_tokens
        if is_copy:
            out["copies"] += 1
            out["copy_tokens"] += recomputed * bs
            out["copy_cost_ms"] += ideal.ttft_ms(prompt, reused * bs) - ideal.ttft_ms(prompt, held_elsewhere * bs)
        for position, node in enumerate(chain):
            if node not in here:
                here[node] = "copy" if is_copy and position < held_elsewhere else "first"
                holders[node] = holders.get(node, 0) + 1
    return out


def copies_lines(summaries: dict[str, dict[str, Any]], medians: bool = False) -> list[str]:
    """One line per run with copies or warm-up hits: how many copies, the prefill they cost, and what later requests
    saved on what they (and warm-ups) brought."""
    lines: list[str] = []
    for name, s in summaries.items():
        if not isinstance(s.get("copies"), (int, float)) or not (s["copies"] or s.get("warmup_saved_tokens")):
            continue
        net = s["copy_saved_ms"] - s["copy_cost_ms"]
        lines.append(
            f"- {name}: {s['copies']:.0f} copies recomputed {s['copy_tokens']:,.0f} held tokens "
            f"({s['copy_cost_ms']:,.0f} ms of prefill); later requests reused {s['copy_saved_tokens']:,.0f} of them "
            f"({s['copy_saved_ms']:,.0f} ms saved, net {net:+,.0f} ms); warm-ups' blocks reused "
            f"{s['warmup_saved_tokens']:,.0f} tokens ({s['warmup_saved_ms']:,.0f} ms saved)")
    heading = ("Copies of held prefixes, and what they saved or cost the requests after them (ideal prefill prices)"
               + (" (median across repeats)" if medians else "") + ":")
    return ["", heading, ""] + lines if lines else []
