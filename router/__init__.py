"""The gateway process: OpenAI-compatible HTTP API, proxying, the replica fleet, tokenization, admin, and the CLI."""
