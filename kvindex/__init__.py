"""kvindex: a cross-pod KV-cache indexer for vLLM fleets.

The code lives in the top-level folders hashing/, replay/, indexer/ and api/, installed as
kvindex.hashing, kvindex.replay, kvindex.indexer and kvindex.api.
"""

__version__ = "0.1.0"
