"""Routing's sections of the policy file: the parity monitor, and the stored responses of the Responses API."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvgate.policies.section import Section


class ParityConfig(Section):
    """The parity monitor: kvgate's prompt token counts and cache credits checked against the engine's on every
    answer (``kvgate_parity_*`` metrics)."""

    window: int = Field(16, ge=1)
    """The last exact prompt counts of a model looked at."""
    untrust_after: int = Field(4, ge=1)
    """Mismatched counts within the window after which the model's exact keys are not trusted: its requests route as
    approximate ones until ``recover_after`` counts in a row match."""
    recover_after: int = Field(8, ge=1)
    """Matching counts in a row that restore trust in a model's exact keys."""
    log_interval_s: float = Field(60.0, ge=0)
    """At most one mismatch warning per model this often (each carries a sample: request id, API, both counts)."""

    @model_validator(mode="after")
    def _within_window(self) -> ParityConfig:
        if self.untrust_after > self.window:
            raise ValueError("untrust_after cannot exceed window: the model could never be untrusted")
        return self


class ResponsesConfig(Section):
    """Responses API: what kvgate remembers of stored responses, so a follow-up (``previous_response_id``) reaches
    the replica that holds the conversation and is tokenized as that engine renders it."""

    max_stored: int = Field(100_000, ge=0)
    """Stored responses remembered (their replica; the least recently used forgotten first). A follow-up of a
    forgotten one is looked for on the model's replicas."""
    max_history_chars: int = Field(64_000_000, ge=0)
    """Characters of stored conversations kept to tokenize follow-ups exactly (least recently used dropped first); a
    follow-up whose history is not kept routes as an approximate request, to the right replica still."""
    lookup_timeout_s: float = Field(2.0, gt=0)
    """How long asking the replicas which one stores a response (one kvgate did not see created) may take."""
