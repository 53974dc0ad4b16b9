"""The store interface: what the write path, the read path and the status views need of an index.

Two implementations: the in-memory `KVIndex` (indexer/index.py, the default, pure) and the Redis/Valkey
store (indexer/stores/redis_store.py, an IO shell over a shared server). Both keep the same semantics (copies
per pod and tier, per-key and per-shard LRU caps, `clear_pod` in O(pod's blocks)); one conformance suite
and one model-based state machine run against both. Typing only: no IO here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from kvindex.indexer.events import KVEvent, PodRef
from kvindex.indexer.index import ApplyStats, Entry, HolderIds, Holders


class StoreUnavailable(Exception):
    """The store could not be read or written (unreachable, timed out, or answered an error).

    A write that raises this may or may not have happened: the caller rebuilds the pod from its ring."""


class StoreReset(StoreUnavailable):
    """The store came back empty (its generation changed): every pod must be rebuilt."""


class LeaseLost(Exception):
    """A fenced write of a pod whose ingest lease this replica no longer holds: nothing was written."""

    def __init__(self, pod: PodRef) -> None:
        super().__init__(f"pod {pod.pod_id} rank {pod.dp_rank}: ingest lease not held")
        self.pod = pod


class Store(Protocol):
    """Block key -> the pod entries (pod, tier) holding it, with copy counts, bounded at both levels.

    Keys live in `num_shards` shards (`shard_of`), each a key LRU of at most `shard_capacity` keys that
    evicts down to `shard_low_water`; a key holds at most `max_pods_per_key` entries. See KVIndex for the
    rules every implementation follows.
    """

    num_shards: int
    max_pods_per_key: int
    shard_capacity: int
    shard_low_water: int

    def shard_of(self, block_key: int) -> int: ...

    # write path
    def apply(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats: ...

    def clear_pod(self, pod: PodRef) -> int: ...

    # read path
    def lookup_ids(
        self, block_keys: Sequence[int], pods: Collection[str] | None = None
    ) -> list[HolderIds]: ...

    def lookup(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[Holders]: ...

    def entry(self, entry_id: int) -> Entry: ...

    def has_pod_id(self, pod_id: str) -> bool: ...

    # stats
    def num_keys(self) -> int: ...

    def num_entries(self) -> int: ...

    def pod_block_count(self, pod: PodRef, tier: str | None = None) -> int: ...

    def pods(self) -> list[PodRef]: ...

    # whole-index views, for tests and debugging (O(index))
    def snapshot(self) -> dict[int, frozenset[Entry]]: ...

    def snapshot_copies(self) -> dict[int, dict[Entry, int]]: ...

    def check_consistency(self) -> list[str]: ...
