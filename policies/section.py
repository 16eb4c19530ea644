"""The prefix index's section of the policy file (``index``), and the base class of every section.

Each section of the policy file is defined next to the component that reads it; the root config
(:mod:`kvgate.router.config`) assembles them. The base lives in this, the lowest layer, so every layer's sections
share it: unknown keys are errors (a typo never silently does nothing), values are frozen, and each field's docstring
is its documentation (docs/configuration.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class IndexConfig(Section):
    max_entries: int = Field(5_000_000, ge=1)
    """Cap on (block, replica) holdings; least recently matched chains are evicted first."""
    predicted_ttl_s: float = Field(2.0, ge=0)
    """Blocks of a just-routed prompt count as held ("predicted") on that replica for this long, or until confirmed."""
    replay_timeout_s: float = Field(2.0, gt=0)
    """How long a replay request may take before the replica is purged instead."""
