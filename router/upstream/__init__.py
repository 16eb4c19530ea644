"""The engines as the gateway calls them: one attempt of a request (the proxy), reading a stream to its first
output, the engine's tokenizer, and what keeps the fleet honest about them (circuit breakers, health checks, metric
scraping)."""
