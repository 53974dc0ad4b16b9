"""`kvindex demo`: a simulated fleet, the real indexer and API, and a shared-prefix workload routed three
ways (kv-aware, round-robin, random), reported with the engines' own cache hits."""
