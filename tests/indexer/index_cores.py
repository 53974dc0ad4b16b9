"""The index's two shard cores for tests: the compiled one (indexer/_shard.c; skipped without it locally,
a failure under CI=true) and shard.py's pure-Python reference, and a way to build a KVIndex on either."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest
from extensions import require_built
from hypothesis import strategies as st
from kvindex.indexer import compiled
from kvindex.indexer.compiled import ShardFactory
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from kvindex.indexer.index import KVIndex
from kvindex.indexer.shard import Shard

CORES = ("compiled", "pure")


def require_extension() -> ShardFactory:
    """The compiled shard type; the test skips without it, and fails under CI=true, which tests both."""
    return require_built(compiled.load_extension(), "kvindex.indexer._shard", "a C compiler")


def require_payload_extension() -> Callable[..., bytes | None]:
    """The compiled batch reader's without_token_ids (skipped or failed like require_extension)."""
    return require_built(compiled.load_payload_extension(), "kvindex.indexer._payload", "a C compiler")


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


def kv_events(
    keys: st.SearchStrategy[int], tiers: Sequence[str], *, max_keys: int = 5, max_events: int = 4
) -> st.SearchStrategy[list[KVEvent]]:
    """Batches of BlocksStored (with or without a parent), BlocksRemoved and AllBlocksCleared over `keys`."""
    return st.lists(
        st.one_of(
            st.builds(
                BlocksStored,
                block_keys=st.lists(keys, max_size=max_keys).map(tuple),
                parent_key=st.none() | keys,
                token_ids=st.just(()),
                block_size=st.just(16),
                tier=st.sampled_from(tiers),
            ),
            st.builds(
                BlocksRemoved,
                block_keys=st.lists(keys, max_size=max_keys).map(tuple),
                tier=st.sampled_from(tiers),
            ),
            st.just(AllBlocksCleared()),
        ),
        max_size=max_events,
    )
