"""Everything that generates or absorbs load: workloads, trace replay, the simulated fleet, benchmarks and reports.

Talks to the rest of kvgate only over the network, like a user would (it may import shared data types).
"""
