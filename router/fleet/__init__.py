"""Fleet state: the replicas, their load and health, a request's attempts on them, peers' reported work, block
sizes, and discovery."""
