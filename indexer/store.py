"""The store interface: what the write path, the read path and the status views need of an index.

Two implementations: the in-memory `KVIndex` (indexer/index.py, the default, pure) and the Redis/Valkey
store (indexer/stores/redis_store.py, an IO shell over a shared server). Both keep the same semantics (copies
per pod and tier, per-key and per-shard LRU caps, `clear_pod` in O(pod's blocks)); one conformance suite
and one model-based state machine run against both. Typing only: no IO here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

import msgspec
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


class LeaseView(msgspec.Struct, frozen=True):
    """One pod's lease as a lease tick left it: its holder's token ('' = free) and the state its owner
    last published ('' = none)."""

    token: str
    state: str


class LeaseClaim(msgspec.Struct, frozen=True):
    """What a replica asks of one pod's lease in a tick: renew `held` (if still ours), take it if free and
    `want`, and publish `state` (its ingest state, if it owns the pod)."""

    pod: PodRef
    held: str | None
    want: bool
    state: str = ""


class Store(Protocol):
    """Block key -> the pod entries (pod, tier) holding it, with copy counts, bounded at both levels.

    Keys live in `num_shards` shards (`shard_of`), each a key LRU of at most `shard_capacity` keys that
    evicts down to `shard_low_water`; a key holds at most `max_pods_per_key` entries. See KVIndex for the
    rules every implementation follows.
    """

    num_shards: int
    max_pods_per_key: int
    # True when calls wait on the network (a remote store): readers then call it off the event loop.
    blocking_io: bool
    shard_capacity: int
    shard_low_water: int

    def shard_of(self, block_key: int) -> int: ...

    # write path
    def apply(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats: ...

    # `apply` of each (pod, events) in order: per batch its stats, or the exception its `apply` raised
    # (that batch left out, the others applied).
    def apply_many(
        self, batches: Sequence[tuple[PodRef, Sequence[KVEvent]]]
    ) -> list[ApplyStats | Exception]: ...

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

    # Every pod's pod_block_count (all tiers) in one read of the store, for status pages over many pods;
    # a pod that holds nothing may be left out.
    def pod_block_counts(self) -> dict[PodRef, int]: ...

    def pods(self) -> list[PodRef]: ...

    # whole-index views, for tests and debugging (O(index))
    def snapshot(self) -> dict[int, frozenset[Entry]]: ...

    def snapshot_copies(self) -> dict[int, dict[Entry, int]]: ...

    def check_consistency(self) -> list[str]: ...


class LeaseStore(Store, Protocol):
    """A store shared by several replicas, which also keeps each pod's ingest lease (the Redis store).

    The lease manager (indexer/ingest/leases.py) calls `lease_tick` for every pod of the model once per
    tick, and `set_fence` with the lease it holds; with `require_fences` on, `apply` and `clear_pod` of a
    pod raise LeaseLost, atomically with the write, unless the store's lease is still that token."""

    def generation(self) -> str: ...

    def require_fences(self) -> None: ...

    def set_fence(self, pod: PodRef, token: str | None) -> None: ...

    def lease_tick(
        self, replica_id: str, ttl_ms: int, claims: Sequence[LeaseClaim]
    ) -> tuple[list[str], list[LeaseView]]: ...

    def release_lease(self, pod: PodRef, token: str) -> None: ...
