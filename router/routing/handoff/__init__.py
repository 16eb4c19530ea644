"""Handoffs: a request prefilled on one replica and decoded on another, one module per engine kind's protocol
(:mod:`.vllm`, :mod:`.sglang`) behind one interface (:mod:`.base`)."""
