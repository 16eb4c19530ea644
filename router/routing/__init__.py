"""Request to decision, and the work decisions start: replication warm-ups and KV transfers."""
