"""Seeded workloads: each builds the exact list of requests a run sends, so a run can be repeated request for request.

A workload is data, not behaviour: arrival offsets, bodies, expected output lengths, and for each request its prompt
length and oracle hits (computed here, from the token ids the workload generated, so the runner never re-tokenizes).
"""

from __future__ import annotations

from kvgate.loadgen.workloads import synthetic
from kvgate.loadgen.workloads.request import Request, WorkloadOptions
from kvgate.loadgen.workloads.trace import trace_workload

WORKLOADS = ("trace", "shared-prefix", "multi-turn", "documents", "agentic", "unique", "pd-mix")


def build_workload(name: str, options: WorkloadOptions) -> list[Request]:
    """The requests of workload ``name``, sorted by arrival (follow-up turns after the first turns)."""
    if name == "trace":
        return trace_workload(options)
    builders = {
        "shared-prefix": synthetic.shared_prefix,
        "multi-turn": synthetic.multi_turn,
        "documents": synthetic.documents,
        "agentic": synthetic.agentic,
        "unique": synthetic.unique,
        "pd-mix": synthetic.pd_mix,
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return builders[name](options)
