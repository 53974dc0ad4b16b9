"""Stage 6 of the write path and stage 3 of the read path: the block index.

A sharded-lock, two-level LRU map: block key -> small LRU of pod entries (pod, dp rank, tier).
Pure and synchronous: no sockets, clocks or threads of its own (locks only, so readers and writers on
different threads are safe).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import msgspec
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, PodRef

# One pod entry: a pod (with its dp rank) holding blocks on one tier.
Entry = tuple[PodRef, str]
# For each prompt block, who holds it: ((pod, tier), ...). Lookups stop at the first block nobody holds.
Holders = tuple[Entry, ...]
# The same, as interned entry ids (resolve with KVIndex.entry); the scorer's fast path.
HolderIds = tuple[int, ...]

# NOTE: a key's holders are stored as a bare entry id while one entry holds it (the common case: most
# blocks live on one pod) and as a dict entry_id -> None, insertion-ordered as the per-key LRU, from the
# second holder on. A dict holder always has >= 2 entries (it is folded back to an int at 1).
_Holders = int | dict[int, None]

_OP_STORE = 0
_OP_REMOVE = 1
_OP_CLEAR = 2
_OP_CHECK_PARENT = 3
# One step of a batch, routed to one shard: (op, entry id, keys) or, for a parent check, (op, 0, key).
_Run = tuple[int, int, list[int] | int]


class ApplyStats(msgspec.Struct, frozen=True):
    """What one `KVIndex.apply` call did, for metrics (the index keeps no counters of its own)."""

    stored_blocks: int = 0  # (block, entry) pairs newly added
    refreshed_blocks: int = 0  # re-stores of a pair already held: recency refreshed
    removed_blocks: int = 0  # pairs dropped by BlocksRemoved
    missing_removals: int = 0  # BlocksRemoved for a pair the index did not hold
    cleared_blocks: int = 0  # pairs dropped by AllBlocksCleared
    unknown_parents: int = 0  # BlocksStored whose parent_key this pod held on no tier at that point
    evicted_keys: int = 0  # keys dropped because their shard was full
    evicted_entries: int = 0  # pairs dropped by either LRU level (may belong to other pods)


# Indices into the mutable counter list a batch accumulates into (same order as ApplyStats' fields).
_STORED, _REFRESHED, _REMOVED, _MISSING, _CLEARED, _UNKNOWN_PARENT, _EVICTED_KEYS, _EVICTED_ENTRIES = range(8)


class _Shard:
    """One lock's worth of the index: the key LRU and the reverse map entry -> keys of this shard."""

    __slots__ = ("lock", "lru", "entry_keys", "capacity", "max_pods_per_key")

    def __init__(self, capacity: int, max_pods_per_key: int) -> None:
        self.lock = threading.Lock()
        # Least recently *stored* key first; reads never move anything.
        self.lru: OrderedDict[int, _Holders] = OrderedDict()
        # NOTE: a set may be left empty by evictions; it is only dropped by clear (a store loop holds a
        # reference to it across evictions).
        self.entry_keys: dict[int, set[int]] = {}
        self.capacity = capacity
        self.max_pods_per_key = max_pods_per_key

    # All methods below run with self.lock held.

    def apply_runs(self, runs: list[_Run], pod_entry_ids: frozenset[int], counts: list[int]) -> None:
        for op, entry_id, arg in runs:
            if op == _OP_STORE:
                assert isinstance(arg, list)
                if arg:
                    self.store(entry_id, arg, counts)
            elif op == _OP_REMOVE:
                assert isinstance(arg, list)
                if arg:
                    self._remove(entry_id, arg, counts)
            elif op == _OP_CHECK_PARENT:
                assert isinstance(arg, int)
                if not self._held_by_any(arg, pod_entry_ids):
                    counts[_UNKNOWN_PARENT] += 1
            else:
                counts[_CLEARED] += self.clear_entries(pod_entry_ids)

    def store(self, entry_id: int, keys: list[int], counts: list[int]) -> None:
        lru = self.lru
        rev = self.entry_keys.get(entry_id)
        if rev is None:
            rev = self.entry_keys[entry_id] = set()
        stored = refreshed = 0
        for key in keys:
            holders = lru.get(key)
            if holders is None:
                lru[key] = entry_id
                rev.add(key)
                stored += 1
                if len(lru) > self.capacity:
                    self._evict_oldest_key(counts)
                continue
            if holders.__class__ is int:
                if holders == entry_id:
                    refreshed += 1
                elif self.max_pods_per_key == 1:
                    self.entry_keys[holders].discard(key)
                    lru[key] = entry_id
                    rev.add(key)
                    stored += 1
                    counts[_EVICTED_ENTRIES] += 1
                else:
                    lru[key] = {holders: None, entry_id: None}
                    rev.add(key)
                    stored += 1
            else:
                holder_lru: dict[int, None] = holders  # type: ignore[assignment]
                if entry_id in holder_lru:
                    del holder_lru[entry_id]  # re-insert: newest in this key's LRU
                    holder_lru[entry_id] = None
                    refreshed += 1
                else:
                    holder_lru[entry_id] = None
                    rev.add(key)
                    stored += 1
                    if len(holder_lru) > self.max_pods_per_key:
                        oldest = next(iter(holder_lru))
                        del holder_lru[oldest]
                        self.entry_keys[oldest].discard(key)
                        counts[_EVICTED_ENTRIES] += 1
            lru.move_to_end(key)
        counts[_STORED] += stored
        counts[_REFRESHED] += refreshed

    def _evict_oldest_key(self, counts: list[int]) -> None:
        key, holders = self.lru.popitem(last=False)
        counts[_EVICTED_KEYS] += 1
        entry_keys = self.entry_keys
        if holders.__class__ is int:
            entry_keys[holders].discard(key)
            counts[_EVICTED_ENTRIES] += 1
        else:
            assert isinstance(holders, dict)
            for entry_id in holders:
                entry_keys[entry_id].discard(key)
            counts[_EVICTED_ENTRIES] += len(holders)

    def _remove(self, entry_id: int, keys: list[int], counts: list[int]) -> None:
        lru = self.lru
        rev = self.entry_keys.get(entry_id)
        if rev is None:
            counts[_MISSING] += len(keys)
            return
        removed = 0
        for key in keys:
            holders = lru.get(key)
            if holders is None:
                continue
            if holders.__class__ is int:
                if holders == entry_id:
                    del lru[key]
                    rev.discard(key)
                    removed += 1
            else:
                assert isinstance(holders, dict)
                if entry_id in holders:
                    del holders[entry_id]
                    rev.discard(key)
                    removed += 1
                    if len(holders) == 1:
                        lru[key] = next(iter(holders))  # same position: removal is not a store
        counts[_REMOVED] += removed
        counts[_MISSING] += len(keys) - removed

    def _held_by_any(self, key: int, entry_ids: frozenset[int]) -> bool:
        holders = self.lru.get(key)
        if holders is None:
            return False
        if holders.__class__ is int:
            return holders in entry_ids
        return not entry_ids.isdisjoint(holders)  # type: ignore[arg-type]

    def clear_entries(self, entry_ids: Iterable[int]) -> int:
        lru = self.lru
        cleared = 0
        for entry_id in entry_ids:
            keys = self.entry_keys.pop(entry_id, None)
            if not keys:
                continue
            for key in keys:
                holders = lru[key]
                if holders.__class__ is int:
                    del lru[key]
                else:
                    assert isinstance(holders, dict)
                    del holders[entry_id]
                    if len(holders) == 1:
                        lru[key] = next(iter(holders))
            cleared += len(keys)
        return cleared


class KVIndex:
    """Block key -> the pod entries holding it, bounded at both levels.

    Keys are spread over `num_shards` shards by `key % num_shards`, each with its own lock. A shard holds at
    most `max(1, max_keys // num_shards)` keys and evicts its least recently *stored* key; a key holds at most
    `max_pods_per_key` entries and evicts its least recently stored entry. Reads never reorder either LRU.
    A batch (`apply`) takes each shard's lock once and applies that shard's part of the batch in event order,
    so a reader sees each key either before or after the whole batch, never in between.
    """

    def __init__(
        self, *, num_shards: int = 16, max_keys: int = 50_000_000, max_pods_per_key: int = 256
    ) -> None:
        if num_shards < 1 or max_keys < 1 or max_pods_per_key < 1:
            raise ValueError(
                f"num_shards, max_keys and max_pods_per_key must be >= 1, got "
                f"{num_shards}, {max_keys}, {max_pods_per_key}"
            )
        self.num_shards = num_shards
        self.max_pods_per_key = max_pods_per_key
        self.shard_capacity = max(1, max_keys // num_shards)
        self._shards = [_Shard(self.shard_capacity, max_pods_per_key) for _ in range(num_shards)]
        # Interned entries: ids are small ints, never reused, append-only (readable without the lock).
        self._intern_lock = threading.Lock()
        self._entries: list[Entry] = []
        self._entry_ids: dict[Entry, int] = {}
        self._pod_entry_ids: dict[PodRef, frozenset[int]] = {}
        self._pod_id_entry_ids: dict[str, frozenset[int]] = {}

    # -- interning ---------------------------------------------------------------------------------

    def _intern(self, pod: PodRef, tier: str) -> int:
        entry = (pod, tier)
        entry_id = self._entry_ids.get(entry)
        if entry_id is not None:
            return entry_id
        if not isinstance(pod, PodRef) or not isinstance(tier, str):
            raise TypeError(f"expected a PodRef and a tier name, got {pod!r}, {tier!r}")
        with self._intern_lock:
            entry_id = self._entry_ids.get(entry)
            if entry_id is None:
                entry_id = len(self._entries)
                self._entries.append(entry)
                self._entry_ids[entry] = entry_id
                self._pod_entry_ids[pod] = self._pod_entry_ids.get(pod, frozenset()) | {entry_id}
                by_id = self._pod_id_entry_ids
                by_id[pod.pod_id] = by_id.get(pod.pod_id, frozenset()) | {entry_id}
            return entry_id

    def entry(self, entry_id: int) -> Entry:
        """The (pod, tier) an id from `lookup_ids` stands for."""
        return self._entries[entry_id]

    def shard_of(self, block_key: int) -> int:
        """Which shard (and so which key LRU) a block key lives in."""
        return block_key % self.num_shards

    # -- write path --------------------------------------------------------------------------------

    def apply(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats:
        """Apply one pod's events in order (a whole batch at once); returns what changed.

        The batch is validated and routed to shards before anything changes, so a bad event (wrong type,
        non-int key) raises TypeError/ValueError and leaves the index untouched. A BlocksStored whose
        parent_key is set but held by this pod on no tier (at that point of the batch) is still applied
        and counted in `unknown_parents`.
        """
        num_shards = self.num_shards
        # Shard -> its part of the batch, in event order; only shards the batch touches appear.
        shard_runs: dict[int, list[_Run]] = {}
        # Per shard, the key list of the current (op, entry) run; None until a key goes there, and reset
        # when the (op, entry) changes or a parent check must come between two keys.
        current: list[list[int] | None] = [None] * num_shards
        mode: tuple[int, int] | None = None
        for event in events:
            if isinstance(event, BlocksStored):
                op, entry_id = _OP_STORE, self._intern(pod, event.tier)
            elif isinstance(event, BlocksRemoved):
                op, entry_id = _OP_REMOVE, self._intern(pod, event.tier)
            elif isinstance(event, AllBlocksCleared):
                for shard_no in range(num_shards):
                    shard_runs.setdefault(shard_no, []).append((_OP_CLEAR, 0, 0))
                current = [None] * num_shards
                mode = None
                continue
            else:
                raise TypeError(f"not a KV event: {type(event).__name__}")
            keys = event.block_keys
            if keys and min(keys) < 0:
                raise ValueError(f"block keys must be unsigned, got {min(keys)}")
            if mode != (op, entry_id):
                mode = (op, entry_id)
                current = [None] * num_shards
            if op == _OP_STORE:
                parent_key = event.parent_key  # type: ignore[union-attr]
                if parent_key is not None:
                    # Checked in the parent's shard at this point of the batch.
                    shard_no = parent_key % num_shards
                    shard_runs.setdefault(shard_no, []).append((_OP_CHECK_PARENT, 0, parent_key))
                    current[shard_no] = None
            for key in keys:
                shard_no = key % num_shards
                bucket = current[shard_no]
                if bucket is None:
                    bucket = current[shard_no] = []
                    runs = shard_runs.get(shard_no)
                    if runs is None:
                        shard_runs[shard_no] = [(op, entry_id, bucket)]
                    else:
                        runs.append((op, entry_id, bucket))
                bucket.append(key)

        counts = [0] * 8
        pod_entry_ids = self._pod_entry_ids.get(pod, frozenset())
        shards = self._shards
        for shard_no, runs in shard_runs.items():
            shard = shards[shard_no]
            with shard.lock:
                if len(runs) == 1 and runs[0][0] == _OP_STORE:
                    shard.store(runs[0][1], runs[0][2], counts)  # type: ignore[arg-type]
                else:
                    shard.apply_runs(runs, pod_entry_ids, counts)
        return ApplyStats(*counts)

    def clear_pod(self, pod: PodRef) -> int:
        """Drop every entry of one pod, all tiers (cost: that pod's blocks); returns how many were dropped."""
        entry_ids = self._pod_entry_ids.get(pod)
        if not entry_ids:
            return 0
        cleared = 0
        for shard in self._shards:
            with shard.lock:
                cleared += shard.clear_entries(entry_ids)
        return cleared

    # -- read path ---------------------------------------------------------------------------------

    def lookup_ids(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[HolderIds]:
        """Entry ids holding each leading block, stopping at the first block no (selected) pod holds.

        Each key is read under its shard's lock (a consistent view per key); reads never reorder the LRU.
        `pods` restricts the answer to those pod ids (every dp rank and tier of each).
        """
        allowed: frozenset[int] | None = None
        if pods is not None:
            by_id = self._pod_id_entry_ids
            allowed = frozenset().union(*(by_id.get(pod_id, ()) for pod_id in pods))
            if not allowed:
                return []
        shards = self._shards
        num_shards = self.num_shards
        result: list[HolderIds] = []
        append = result.append
        for key in block_keys:
            shard = shards[key % num_shards]
            with shard.lock:
                holders = shard.lru.get(key)
                if holders is None:
                    break
                ids: HolderIds = (holders,) if holders.__class__ is int else tuple(holders)  # type: ignore[arg-type]
            if allowed is not None:
                ids = tuple(entry_id for entry_id in ids if entry_id in allowed)
                if not ids:
                    break
            append(ids)
        return result

    def lookup(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[Holders]:
        """Holders of each leading block, stopping at the first block no (selected) pod holds.

        Reads never reorder the LRU. Within one key, holders are listed least recently stored first.
        """
        entries = self._entries
        return [tuple(entries[i] for i in ids) for ids in self.lookup_ids(block_keys, pods)]

    # -- stats (O(entries of the index's pods x shards), not O(blocks)) ------------------------------

    def num_keys(self) -> int:
        return sum(len(shard.lru) for shard in self._shards)

    def num_entries(self) -> int:
        """(block, pod entry) pairs held, counting a block once per pod and tier."""
        return sum(len(keys) for shard in self._shards for keys in list(shard.entry_keys.values()))

    def pod_block_count(self, pod: PodRef, tier: str | None = None) -> int:
        """Blocks one pod holds, counted once per tier (or on `tier` only)."""
        total = 0
        for entry_id in self._pod_entry_ids.get(pod, ()):
            if tier is not None and self._entries[entry_id][1] != tier:
                continue
            for shard in self._shards:
                keys = shard.entry_keys.get(entry_id)
                if keys:
                    total += len(keys)
        return total

    def pods(self) -> list[PodRef]:
        """Pods (with dp rank) holding at least one block, sorted."""
        return sorted(pod for pod in list(self._pod_entry_ids) if self.pod_block_count(pod))

    # -- whole-index views, for tests and debugging (O(index)) ----------------------------------------

    def snapshot(self) -> dict[int, frozenset[Entry]]:
        """Every key and its holders (takes each shard lock once)."""
        entries = self._entries
        result: dict[int, frozenset[Entry]] = {}
        for shard in self._shards:
            with shard.lock:
                for key, holders in shard.lru.items():
                    ids = (holders,) if holders.__class__ is int else tuple(holders)  # type: ignore[arg-type]
                    result[key] = frozenset(entries[i] for i in ids)
        return result

    def check_consistency(self) -> list[str]:
        """Violations of the index's invariants (empty when sound): caps, shard routing, reverse map."""
        problems: list[str] = []
        for shard_no, shard in enumerate(self._shards):
            with shard.lock:
                if len(shard.lru) > shard.capacity:
                    problems.append(f"shard {shard_no}: {len(shard.lru)} keys > {shard.capacity}")
                forward: set[tuple[int, int]] = set()
                for key, holders in shard.lru.items():
                    if key % self.num_shards != shard_no:
                        problems.append(f"key {key} in shard {shard_no}")
                    if isinstance(holders, dict):
                        if not 2 <= len(holders) <= self.max_pods_per_key:
                            problems.append(f"key {key}: {len(holders)} holders in a dict")
                        forward.update((entry_id, key) for entry_id in holders)
                    else:
                        forward.add((holders, key))
                reverse = {(e, key) for e, keys in shard.entry_keys.items() for key in keys}
                if forward != reverse:
                    problems.append(
                        f"shard {shard_no}: reverse map differs, {len(forward - reverse)} missing, "
                        f"{len(reverse - forward)} stale"
                    )
        return problems
