"""Stage 6 of the write path and stage 3 of the read path: the block index.

A sharded-lock, two-level LRU map: block key -> small LRU of pod entries (pod, dp rank, tier), each with
the number of physical copies the pod announced. Pure and synchronous: no sockets, clocks or threads of
its own (locks only, so readers and writers on different threads are safe).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Collection, Iterable, Sequence
from itertools import islice

import msgspec
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, PodRef

# One pod entry: a pod (with its dp rank) holding blocks on one tier.
Entry = tuple[PodRef, str]
# For each prompt block, who holds it: ((pod, tier), ...). Lookups stop at the first block nobody holds.
Holders = tuple[Entry, ...]
# The same, as interned entry ids (resolve with KVIndex.entry); the scorer's fast path.
HolderIds = tuple[int, ...]

# NOTE: a key's holders are a bare entry id while one entry holds it with one copy (the common case: most
# blocks live on one pod, once), else a dict entry_id -> copies, insertion-ordered as the per-key LRU. A
# dict holder has >= 2 entries or one entry with >= 2 copies (it is folded back to an int otherwise).
# Small dicts of ints are not tracked by the garbage collector, so the index adds no GC work.
_Holders = int | dict[int, int]

# Copies of one (key, entry) counted at most. vLLM keeps identical blocks apart (BlockHashToBlockMap does
# not de-duplicate): a fully cached block-aligned prompt recomputes its last block into a second physical
# block with the same hash, and hybrid models store one hash per KV-cache group; each copy is announced
# by a BlockStored and evicted by its own BlockRemoved. Re-announcements in vLLM's "full"
# kv_cache_report_mode (emit_cached_block_events) re-store held blocks without a new copy and so inflate
# the count: one later eviction then leaves a stale entry until the key LRU or a clear drops it. A small
# cap would not help (a count of 2 is already stale after one eviction) and would drop blocks a busy pod
# really holds twice or more; 256 bounds the count by what one pod can plausibly run at once and keeps
# every count one of CPython's shared small ints (no allocation per count).
MAX_COPIES = 256

_OP_STORE = 0
_OP_REMOVE = 1
_OP_CLEAR = 2
_OP_CHECK_PARENT = 3
# A store's keys, and the same as an array (checked unsigned 64-bit, appended to the reverse-map log).
_KeyGroup = tuple[Sequence[int], "array[int]"]
# One step of a batch, routed to one shard: (op, entry id, arg) where arg is a list of key groups for a
# store, the keys for a removal, the parent key for a parent check, 0 for a clear.
_Run = tuple[int, int, "list[_KeyGroup] | Sequence[int] | int"]


class ApplyStats(msgspec.Struct, frozen=True):
    """What one `KVIndex.apply` call did, for metrics (the index keeps no counters of its own)."""

    stored_blocks: int = 0  # (block, entry) pairs newly added
    refreshed_blocks: int = 0  # re-stores of a pair already held: one more copy, recency refreshed
    removed_blocks: int = 0  # pairs dropped by BlocksRemoved (their last copy went)
    missing_removals: int = 0  # BlocksRemoved for a pair the index did not hold
    cleared_blocks: int = 0  # pairs dropped by AllBlocksCleared
    unknown_parents: int = 0  # BlocksStored whose parent_key this pod held on no tier at that point
    evicted_keys: int = 0  # keys dropped because their shard was full
    evicted_entries: int = 0  # pairs dropped by either LRU level (may belong to other pods)
    released_copies: int = 0  # BlocksRemoved that dropped one of several copies: the pair stays held


# Indices into the mutable counter list a batch accumulates into (same order as ApplyStats' fields).
(
    _STORED,
    _REFRESHED,
    _REMOVED,
    _MISSING,
    _CLEARED,
    _UNKNOWN_PARENT,
    _EVICTED_KEYS,
    _EVICTED_ENTRIES,
    _RELEASED,
) = range(9)


class _Shard:
    """One lock's worth of the index: the key LRU and, per entry, a log of the keys it stored here."""

    __slots__ = (
        "lock",
        "holders",
        "frozen",
        "interned",
        "entry_keys",
        "entry_live",
        "capacity",
        "low_water",
        "max_pods_per_key",
    )

    def __init__(self, capacity: int, max_pods_per_key: int) -> None:
        self.lock = threading.Lock()
        # Block key -> holders; a plain dict is insertion-ordered, so it is the key LRU (least recently
        # *stored* first; a store re-inserts, reads never move anything). An OrderedDict would cost ~75 B
        # more per key.
        self.holders: dict[int, _Holders] = {}
        # NOTE: lookups answer a dict holder with an immutable tuple of its ids, made on first read and
        # dropped by any write to that key; tuples are interned, so the blocks of a shared prefix share one
        # (no copy per read, and the scorer sees runs by identity). ~1 pointer per multi-holder pair.
        self.frozen: dict[int, HolderIds] = {}
        self.interned: dict[HolderIds, HolderIds] = {}
        # NOTE: the reverse map is a log, not a set (8 B per pair instead of ~60): every key an entry
        # stored here is appended; removals and evictions leave it stale (readers re-check `holders`), and
        # a store compacts it once it is twice the live count. A log whose entry holds nothing is dropped.
        self.entry_keys: dict[int, array[int]] = {}
        # Entry -> pairs it holds in this shard (exact; the log may be longer).
        self.entry_live: dict[int, int] = {}
        self.capacity = capacity
        # A full shard evicts down to this many keys at once: one scan of the dict's deleted slots per
        # round instead of one per key (a plain dict's oldest live key sits behind them).
        self.low_water = capacity - capacity // 64
        self.max_pods_per_key = max_pods_per_key

    # All methods below run with self.lock held.

    def apply_runs(self, runs: Iterable[_Run], pod_entry_ids: frozenset[int], counts: list[int]) -> None:
        for op, entry_id, arg in runs:
            if op == _OP_STORE:
                self.store(entry_id, arg, counts)  # type: ignore[arg-type]
            elif op == _OP_REMOVE:
                self.remove(entry_id, arg, counts)  # type: ignore[arg-type]
            elif op == _OP_CHECK_PARENT:
                if not self.held_by_any(arg, pod_entry_ids):  # type: ignore[arg-type]
                    counts[_UNKNOWN_PARENT] += 1
            else:
                counts[_CLEARED] += self.clear_entries(pod_entry_ids)

    def store(self, entry_id: int, key_groups: Sequence[_KeyGroup], counts: list[int]) -> None:
        """Store each group's keys in order (consecutive events of one entry, merged by the caller)."""
        holders_map = self.holders
        log = self.entry_keys.get(entry_id)
        if log is None:
            log = self.entry_keys[entry_id] = array("Q")
        unheld = holders_map.keys().isdisjoint
        stored = 0
        for keys, key_array in key_groups:
            # Logged whole: keys already held by this entry just leave a duplicate for compaction.
            log.extend(key_array)
            if unheld(keys):
                # NOTE: the common case (fresh blocks) in C: dict.fromkeys keeps order, so the key LRU
                # order is the same as storing one by one. A key repeated in the group is a second copy:
                # the slow path counts it.
                fresh = dict.fromkeys(keys, entry_id)
                if len(fresh) == len(keys):
                    holders_map.update(fresh)
                    stored += len(keys)
                    continue
            stored += self._store_each(entry_id, keys, counts)
        live = self.entry_live
        live[entry_id] = live.get(entry_id, 0) + stored
        counts[_STORED] += stored
        if len(holders_map) > self.capacity:
            self._evict_oldest_keys(counts)
        if len(log) > 2 * live.get(entry_id, 0) + 64:
            self._compact(entry_id)

    def _store_each(self, entry_id: int, keys: Sequence[int], counts: list[int]) -> int:
        """Store keys one at a time (some already held); returns the pairs newly added."""
        holders_map = self.holders
        pop = holders_map.pop
        live = self.entry_live
        frozen = self.frozen  # empty until a lookup reads a multi-holder key: then skip its pops
        max_pods_per_key = self.max_pods_per_key
        stored = refreshed = evicted = 0
        for key in keys:
            held = pop(key, None)  # re-inserted below: newest in the key LRU
            if held is None:
                holders_map[key] = entry_id
                stored += 1
            elif held.__class__ is int:
                if held == entry_id:
                    holders_map[key] = {entry_id: 2}
                    refreshed += 1
                elif max_pods_per_key == 1:
                    live[held] -= 1
                    holders_map[key] = entry_id
                    stored += 1
                    evicted += 1
                else:
                    holders_map[key] = {held: 1, entry_id: 1}
                    stored += 1
            else:
                holder_lru: dict[int, int] = held  # type: ignore[assignment]
                if frozen:
                    frozen.pop(key, None)
                copies = holder_lru.pop(entry_id, 0)  # re-inserted: newest in this key's LRU
                if copies:
                    holder_lru[entry_id] = copies + 1 if copies < MAX_COPIES else MAX_COPIES
                    refreshed += 1
                else:
                    holder_lru[entry_id] = 1
                    stored += 1
                    if len(holder_lru) > max_pods_per_key:
                        oldest = next(iter(holder_lru))
                        del holder_lru[oldest]
                        live[oldest] -= 1
                        evicted += 1
                        if len(holder_lru) == 1:  # max_pods_per_key == 1 and a single new copy
                            holders_map[key] = entry_id
                            continue
                holders_map[key] = holder_lru
        counts[_REFRESHED] += refreshed
        counts[_EVICTED_ENTRIES] += evicted
        return stored

    def _evict_oldest_keys(self, counts: list[int]) -> None:
        holders_map = self.holders
        victims = list(islice(holders_map, len(holders_map) - self.low_water))
        live = self.entry_live
        evicted_entries = 0
        for key in victims:
            held = holders_map.pop(key)
            if held.__class__ is int:
                live[held] -= 1
                evicted_entries += 1
            else:
                self.frozen.pop(key, None)
                for entry_id in held:  # type: ignore[union-attr]
                    live[entry_id] -= 1
                evicted_entries += len(held)  # type: ignore[arg-type]
        counts[_EVICTED_KEYS] += len(victims)
        counts[_EVICTED_ENTRIES] += evicted_entries

    def _compact(self, entry_id: int) -> None:
        """Rewrite one entry's log with exactly the keys it holds (each once)."""
        holds = self.holds
        held_keys = [key for key in dict.fromkeys(self.entry_keys[entry_id]) if holds(key, entry_id)]
        self.entry_keys[entry_id] = array("Q", held_keys)

    def freeze(self, key: int, holder_lru: dict[int, int]) -> HolderIds:
        """The ids of a dict holder as a shared tuple (cached until the key is next written)."""
        ids = tuple(holder_lru)
        interned = self.interned
        if len(interned) > 2 * len(self.frozen) + 1024:
            # Drop tuples no key answers with any more.
            interned.clear()
            interned.update((frozen, frozen) for frozen in self.frozen.values())
        ids = interned.setdefault(ids, ids)
        self.frozen[key] = ids
        return ids

    def holds(self, key: int, entry_id: int) -> bool:
        held = self.holders.get(key)
        if held is None:
            return False
        if held.__class__ is int:
            return held == entry_id
        return entry_id in held  # type: ignore[operator]

    def remove(self, entry_id: int, keys: Sequence[int], counts: list[int]) -> None:
        holders_map = self.holders
        removed = released = 0
        for key in keys:
            held = holders_map.get(key)
            if held is None:
                continue
            if held.__class__ is int:
                if held == entry_id:
                    del holders_map[key]
                    removed += 1
                continue
            holder_lru: dict[int, int] = held  # type: ignore[assignment]
            copies = holder_lru.get(entry_id)
            if copies is None:
                continue
            self.frozen.pop(key, None)
            # Removal is not a store: the key and the entry keep their places in both LRUs.
            if copies > 1:
                holder_lru[entry_id] = copies - 1
                released += 1
            else:
                del holder_lru[entry_id]
                removed += 1
            _fold(holders_map, key, holder_lru)
        counts[_REMOVED] += removed
        counts[_RELEASED] += released
        counts[_MISSING] += len(keys) - removed - released
        if removed:
            left = self.entry_live[entry_id] - removed
            self.entry_live[entry_id] = left
            if not left:
                del self.entry_keys[entry_id]

    def held_by_any(self, key: int, entry_ids: frozenset[int]) -> bool:
        held = self.holders.get(key)
        if held is None:
            return False
        if held.__class__ is int:
            return held in entry_ids
        return not entry_ids.isdisjoint(held)  # type: ignore[arg-type]

    def clear_entries(self, entry_ids: Iterable[int]) -> int:
        """Drop every pair of these entries (cost: the length of their logs); returns pairs dropped."""
        holders_map = self.holders
        cleared = 0
        for entry_id in entry_ids:
            log = self.entry_keys.pop(entry_id, None)
            self.entry_live.pop(entry_id, None)
            if log is None:
                continue
            for key in log:
                held = holders_map.get(key)
                if held is None:
                    continue
                if held.__class__ is int:
                    if held == entry_id:
                        del holders_map[key]
                        cleared += 1
                elif entry_id in held:  # type: ignore[operator]
                    holder_lru: dict[int, int] = held  # type: ignore[assignment]
                    self.frozen.pop(key, None)
                    del holder_lru[entry_id]
                    cleared += 1
                    _fold(holders_map, key, holder_lru)
        return cleared


def _fold(holders_map: dict[int, _Holders], key: int, holder_lru: dict[int, int]) -> None:
    """Restore the holder invariant after a pair lost copies (the key keeps its LRU place)."""
    if len(holder_lru) > 1:
        return
    if not holder_lru:
        del holders_map[key]
        return
    ((only, only_copies),) = holder_lru.items()
    if only_copies == 1:
        holders_map[key] = only


def _checked_keys(keys: Sequence[int]) -> array[int]:
    """The keys as an array; refuses anything but unsigned 64-bit ints, before a batch changes anything."""
    try:
        return array("Q", keys)
    except (TypeError, OverflowError) as exc:
        bad = next((key for key in keys if not isinstance(key, int)), None)
        if bad is not None:
            raise TypeError(f"block keys must be ints, got {bad!r}") from exc
        raise ValueError(f"block keys must be unsigned 64-bit ints, got {min(keys)}..{max(keys)}") from exc


class KVIndex:
    """Block key -> the pod entries holding it (with their copy counts), bounded at both levels.

    Keys are spread over `num_shards` shards by `key % num_shards`, each with its own lock (one shard by
    default: under the GIL more shards only add routing work; more help only free-threaded builds). A
    shard holds at most `shard_capacity = max(1, max_keys // num_shards)` keys: past that it evicts its
    least recently *stored* keys down to `shard_low_water` (capacity minus 1/64th; exactly the overflow
    below 64 keys). A key holds at most `max_pods_per_key` entries and evicts its least recently stored
    entry. Reads never reorder either LRU.

    Copies: BlocksStored of a pair already held adds a copy (up to MAX_COPIES) and refreshes recency;
    BlocksRemoved drops one copy and the pair only with its last; AllBlocksCleared / clear_pod drop the
    pod's pairs whatever their counts. Re-announcements of held blocks (vLLM's "full" kv_cache_report_mode)
    inflate counts, so a later eviction can leave a stale pair until the key LRU or a clear drops it: see
    MAX_COPIES. A batch (`apply`) takes each shard's lock once and applies that shard's part of the batch
    in event order, so a reader sees each key either before or after the whole batch, never in between.

    Memory: ~100 B per (pod, block) pair at 1M pairs, block keys included (benchmarks/index.py).
    """

    def __init__(
        self, *, num_shards: int = 1, max_keys: int = 50_000_000, max_pods_per_key: int = 256
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
        self.shard_low_water = self._shards[0].low_water
        # Interned entries: ids are small ints, never reused, append-only (readable without the lock).
        self._intern_lock = threading.Lock()
        self._entries: list[Entry] = []
        # entry id -> (entry id,): the lookup answer for a single holder, shared instead of allocated.
        self._single_ids: list[HolderIds] = []
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
                self._single_ids.append((entry_id,))
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

        The batch is validated (and routed to shards) before anything changes, so a bad event (wrong
        type, a key that is not an unsigned 64-bit int) raises TypeError/ValueError and leaves the index
        untouched. A BlocksStored whose parent_key is set but held by this pod on no tier (at that point
        of the batch) is still applied and counted in `unknown_parents`.
        """
        if self.num_shards == 1:
            steps = self._validate(pod, events)
            counts = [0] * 9
            shard = self._shards[0]
            pod_entry_ids = self._pod_entry_ids.get(pod, frozenset())
            with shard.lock:
                shard.apply_runs(steps, pod_entry_ids, counts)
            return ApplyStats(*counts)
        return self._apply_sharded(pod, events)

    def _validate(self, pod: PodRef, events: Iterable[KVEvent]) -> list[_Run]:
        """The batch as one shard's steps, in event order; raises before anything changes.

        Consecutive BlocksStored of one tier whose parent is the previous event's last block (a chain
        continued, the usual shape) merge into one store step: that parent is held at that point.
        """
        steps: list[_Run] = []
        tier_entry_ids: dict[str, int] = {}
        last_store: list[_KeyGroup] | None = None  # the previous step, if it is a store
        last_entry_id = last_key = -1
        for event in events:
            if isinstance(event, BlocksStored):
                tier = event.tier
                entry_id = tier_entry_ids.get(tier)
                if entry_id is None:
                    entry_id = tier_entry_ids[tier] = self._intern(pod, tier)
                keys = event.block_keys
                key_array = _checked_keys(keys)
                parent_key = event.parent_key
                if parent_key is not None:
                    if last_store is not None and parent_key == last_key and entry_id == last_entry_id:
                        if keys:
                            last_store.append((keys, key_array))
                            last_key = keys[-1]
                        continue
                    _checked_keys((parent_key,))
                    steps.append((_OP_CHECK_PARENT, 0, parent_key))
                if keys:
                    last_store = [(keys, key_array)]
                    last_entry_id, last_key = entry_id, keys[-1]
                    steps.append((_OP_STORE, entry_id, last_store))
                else:
                    last_store = None
                continue
            last_store = None
            if isinstance(event, BlocksRemoved):
                entry_id = self._intern(pod, event.tier)
                keys = event.block_keys
                _checked_keys(keys)
                if keys:
                    steps.append((_OP_REMOVE, entry_id, keys))
            elif isinstance(event, AllBlocksCleared):
                steps.append((_OP_CLEAR, 0, 0))
            else:
                raise TypeError(f"not a KV event: {type(event).__name__}")
        return steps

    def _apply_sharded(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats:
        num_shards = self.num_shards
        # Shard -> its part of the batch, in event order; only shards the batch touches appear.
        shard_runs: dict[int, list[_Run]] = {}
        for op, entry_id, arg in self._validate(pod, events):
            if op == _OP_CLEAR:
                for shard_no in range(num_shards):
                    shard_runs.setdefault(shard_no, []).append((op, entry_id, arg))
            elif op == _OP_CHECK_PARENT:
                shard_runs.setdefault(arg % num_shards, []).append((op, entry_id, arg))  # type: ignore[operator]
            else:
                # One key list per shard this step touches (no per-block tuples).
                all_keys: list[Sequence[int]]
                if op == _OP_STORE:
                    all_keys = [keys for keys, _ in arg]  # type: ignore[union-attr,misc]
                else:
                    all_keys = [arg]  # type: ignore[list-item]
                buckets: dict[int, list[int]] = {}
                for keys in all_keys:
                    for key in keys:
                        bucket = buckets.get(key % num_shards)
                        if bucket is None:
                            buckets[key % num_shards] = [key]
                        else:
                            bucket.append(key)
                for shard_no, bucket in buckets.items():
                    part: list[_KeyGroup] | list[int] = bucket
                    if op == _OP_STORE:
                        group: _KeyGroup = (bucket, array("Q", bucket))
                        part = [group]
                    shard_runs.setdefault(shard_no, []).append((op, entry_id, part))
        counts = [0] * 9
        pod_entry_ids = self._pod_entry_ids.get(pod, frozenset())
        shards = self._shards
        for shard_no, runs in shard_runs.items():
            shard = shards[shard_no]
            with shard.lock:
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

        The whole lookup runs under every shard's lock (taken in shard order), so it sees each batch
        either entirely or not at all; reads never reorder the LRU. `pods` restricts the answer to those
        pod ids (every dp rank and tier of each). Within one key, ids are least recently stored first.
        Single-holder answers are shared tuples: treat the result as read-only.
        """
        allowed: frozenset[int] | None = None
        if pods is not None:
            by_id = self._pod_id_entry_ids
            allowed = frozenset().union(*(by_id.get(pod_id, ()) for pod_id in pods))
            if not allowed:
                return []
        single_ids = self._single_ids
        result: list[HolderIds] = []
        append = result.append
        shards = self._shards
        locks = [shard.lock for shard in shards]
        for lock in locks:
            lock.acquire()
        try:
            if len(shards) == 1:
                shard = shards[0]
                get = shard.holders.get
                frozen_get = shard.frozen.get
                for key in block_keys:
                    held = get(key)
                    if held is None:
                        break
                    if held.__class__ is int:
                        append(single_ids[held])
                    else:
                        ids = frozen_get(key)
                        append(ids if ids is not None else shard.freeze(key, held))  # type: ignore[arg-type]
            else:
                num_shards = len(shards)
                for key in block_keys:
                    shard = shards[key % num_shards]
                    held = shard.holders.get(key)
                    if held is None:
                        break
                    if held.__class__ is int:
                        append(single_ids[held])
                    else:
                        ids = shard.frozen.get(key)
                        append(ids if ids is not None else shard.freeze(key, held))  # type: ignore[arg-type]
        finally:
            for lock in reversed(locks):
                lock.release()
        if allowed is None:
            return result
        filtered: list[HolderIds] = []
        for ids in result:
            kept = tuple(entry_id for entry_id in ids if entry_id in allowed)
            if not kept:
                break
            filtered.append(kept)
        return filtered

    def lookup(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[Holders]:
        """Holders of each leading block, stopping at the first block no (selected) pod holds.

        Reads never reorder the LRU. Within one key, holders are listed least recently stored first.
        """
        entries = self._entries
        result: list[Holders] = []
        last_ids: HolderIds = ()
        last_holders: Holders = ()
        for ids in self.lookup_ids(block_keys, pods):
            # Blocks of a shared prefix come back as one interned tuple: resolve it once per run.
            if ids is not last_ids:
                last_ids, last_holders = ids, tuple([entries[i] for i in ids])
            result.append(last_holders)
        return result

    # -- stats (O(entries of the index's pods x shards), not O(blocks)) ------------------------------

    def num_keys(self) -> int:
        return sum(len(shard.holders) for shard in self._shards)

    def num_entries(self) -> int:
        """(block, pod entry) pairs held, counting a block once per pod and tier (not per copy)."""
        return sum(sum(list(shard.entry_live.values())) for shard in self._shards)

    def pod_block_count(self, pod: PodRef, tier: str | None = None) -> int:
        """Blocks one pod holds, counted once per tier (or on `tier` only), not per copy."""
        total = 0
        for entry_id in self._pod_entry_ids.get(pod, ()):
            if tier is not None and self._entries[entry_id][1] != tier:
                continue
            for shard in self._shards:
                total += shard.entry_live.get(entry_id, 0)
        return total

    def has_pod_id(self, pod_id: str) -> bool:
        """True once this pod id (any dp rank or tier) has held a block here; clears do not reset it."""
        return pod_id in self._pod_id_entry_ids

    def pods(self) -> list[PodRef]:
        """Pods (with dp rank) holding at least one block, sorted."""
        return sorted(pod for pod in list(self._pod_entry_ids) if self.pod_block_count(pod))

    # -- whole-index views, for tests and debugging (O(index)) ----------------------------------------

    def snapshot(self) -> dict[int, frozenset[Entry]]:
        """Every key and its holders (takes each shard lock once)."""
        return {key: frozenset(entries) for key, entries in self.snapshot_copies().items()}

    def snapshot_copies(self) -> dict[int, dict[Entry, int]]:
        """Every key and its holders with their copy counts (takes each shard lock once)."""
        entries = self._entries
        result: dict[int, dict[Entry, int]] = {}
        for shard in self._shards:
            with shard.lock:
                for key, held in shard.holders.items():
                    copies = {held: 1} if held.__class__ is int else held
                    result[key] = {entries[i]: count for i, count in copies.items()}  # type: ignore[union-attr]
        return result

    def check_consistency(self) -> list[str]:
        """Violations of the index's invariants (empty when sound): caps, shard routing, reverse map."""
        problems: list[str] = []
        for shard_no, shard in enumerate(self._shards):
            with shard.lock:
                if len(shard.holders) > shard.capacity:
                    problems.append(f"shard {shard_no}: {len(shard.holders)} keys > {shard.capacity}")
                live: dict[int, int] = {}
                logged = {entry_id: set(log) for entry_id, log in shard.entry_keys.items()}
                for key, held in shard.holders.items():
                    if key % self.num_shards != shard_no:
                        problems.append(f"key {key} in shard {shard_no}")
                    if isinstance(held, dict):
                        if not 1 <= len(held) <= self.max_pods_per_key:
                            problems.append(f"key {key}: {len(held)} holders in a dict")
                        if len(held) == 1 and next(iter(held.values())) == 1:
                            problems.append(f"key {key}: one holder with one copy left in a dict")
                        if not all(1 <= count <= MAX_COPIES for count in held.values()):
                            problems.append(f"key {key}: copy counts out of range {held}")
                        ids: Iterable[int] = held
                    else:
                        ids = (held,)
                    for entry_id in ids:
                        live[entry_id] = live.get(entry_id, 0) + 1
                        if key not in logged.get(entry_id, ()):
                            problems.append(
                                f"shard {shard_no}: key {key} missing from entry {entry_id}'s log"
                            )
                for key, ids in shard.frozen.items():
                    frozen_of = shard.holders.get(key)
                    if not isinstance(frozen_of, dict) or tuple(frozen_of) != ids:
                        problems.append(f"shard {shard_no}: stale lookup tuple for key {key}")
                counted = {entry_id: n for entry_id, n in shard.entry_live.items() if n}
                if counted != live:
                    problems.append(f"shard {shard_no}: live counts {counted} != held pairs {live}")
        return problems
