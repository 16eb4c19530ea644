"""The engines as the gateway calls them: the proxy, and what keeps it resilient (circuit breakers, first-token
deadlines, health checks, metric scraping)."""
