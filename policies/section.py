"""The base class of every section of the policy file.

Each section is defined next to the component that reads it (the policies' here in :mod:`kvgate.policies.config`,
the gateway's in its own packages) and the gateway's root schema assembles them. The base lives in the lowest
package that reads sections, so every layer's share it: unknown keys are errors (a typo never silently does
nothing), values are frozen, and each field's docstring is its documentation (docs/configuration.md). The prefix
index reads none: it takes plain arguments.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
