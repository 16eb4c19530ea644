"""Gateway replicas helping each other: a starting gateway takes its prefix index from a running peer."""
