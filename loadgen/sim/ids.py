"""The random ids vLLM makes for what a request does not name itself (``vllm.utils.random_uuid``)."""

from __future__ import annotations

import uuid

MASK_64_BITS = (1 << 64) - 1


def random_id() -> str:
    """16 hex digits: the low 64 bits of a uuid4, as vLLM's ``random_uuid`` (request, response and item ids)."""
    return f"{uuid.uuid4().int & MASK_64_BITS:016x}"
