"""What routing decides with and what its decisions start: the model catalog and each model's state (cost model,
policy, calibration), replicas' views, predictions and sessions, and the upstream work a decision sets off
(replication warm-ups, KV transfers, handoffs between replicas)."""
