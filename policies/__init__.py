"""Routing decisions: the cost model, the policies, replication and transfer planning, and the policy-file schema.

Pure logic over snapshots handed in by the router; no I/O here, so every decision can be unit-tested.
"""
