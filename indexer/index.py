"""Stage 6 of the write path and stage 3 of the read path: the block index.

A sharded-lock, two-level LRU map: block key -> small LRU of pod entries (pod, dp rank, tier).
Pure and synchronous: no sockets, clocks or threads of its own (locks only, so readers and writers on
different threads are safe).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvindex.indexer.events import KVEvent, PodRef

# For each prompt block, who holds it: ((pod, tier), ...). Lookups stop at the first block nobody holds.
Holders = tuple[tuple[PodRef, str], ...]


class KVIndex:
    def __init__(
        self, *, num_shards: int = 16, max_keys: int = 50_000_000, max_pods_per_key: int = 256
    ) -> None:
        raise NotImplementedError

    def apply(self, pod: PodRef, events: Iterable[KVEvent]) -> None:
        """Apply one pod's events in order (a whole batch at once)."""
        raise NotImplementedError

    def clear_pod(self, pod: PodRef) -> int:
        """Drop every entry of one pod (cost: that pod's blocks); returns how many were dropped."""
        raise NotImplementedError

    def lookup(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[Holders]:
        """Holders of each leading block, stopping at the first block no (selected) pod holds.

        Reads never reorder the LRU.
        """
        raise NotImplementedError

    def num_keys(self) -> int:
        raise NotImplementedError

    def num_entries(self) -> int:
        raise NotImplementedError

    def pod_block_count(self, pod: PodRef) -> int:
        raise NotImplementedError
