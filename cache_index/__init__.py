"""The global prefix index and everything that feeds it.

Block keys, KV-event decoding (every vLLM encoding, SGLang), per-replica subscriptions with sequence tracking,
replay and generations. Knows nothing about HTTP or routing policies.
"""
