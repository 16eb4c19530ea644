"""A simulated fleet of vLLM-compatible replicas in one process (``kvgate sim``).

Each replica speaks vLLM's public interfaces byte for byte (OpenAI HTTP API, Anthropic Messages and OpenAI
Responses, ``/metrics``, ``/health``, the ZMQ KV-event publisher with replay, NixlConnector ``kv_transfer_params``)
over a paged prefix cache and a time model of continuous batching, so the router can be developed and benchmarked
without a GPU and then run unchanged against real engines.
"""
