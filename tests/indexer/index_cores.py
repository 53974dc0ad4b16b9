"""The index's two shard cores for tests: the compiled one (indexer/_shard.c; skipped without it locally,
a failure under CI=true) and shard.py's pure-Python reference, and a way to build a KVIndex on either."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kvindex.indexer import compiled
from kvindex.indexer.compiled import ShardFactory
from kvindex.indexer.index import KVIndex
from kvindex.indexer.shard import Shard

CORES = ("compiled", "pure")


def require_extension() -> ShardFactory:
    """The compiled shard type; the test skips without it, and fails under CI=true, which tests both."""
    shard_type = compiled.load_extension()
    if shard_type is None:
        message = "kvindex.indexer._shard was not built (needs a C compiler)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must test the compiled index core too")
        pytest.skip(message)
    return shard_type


def shard_type_of(core: str) -> ShardFactory:
    return require_extension() if core == "compiled" else Shard


@contextmanager
def using_core(core: str) -> Iterator[None]:
    """KVIndexes made inside run on this core (KVIndex reads indexer.compiled.shard_type when made)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "shard_type", shard_type_of(core))
        yield


def make_index(
    core: str, num_shards: int = 1, max_keys: int = 50_000_000, max_pods_per_key: int = 256
) -> KVIndex:
    with using_core(core):
        return KVIndex(num_shards=num_shards, max_keys=max_keys, max_pods_per_key=max_pods_per_key)
