"""Store implementations that do IO (the in-memory KVIndex lives in indexer/index.py)."""
