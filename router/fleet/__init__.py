"""Fleet state: the replicas, their load and health, block sizes, and discovery."""
