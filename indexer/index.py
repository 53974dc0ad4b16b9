"""Stage 6 of the write path and stage 3 of the read path: the block index.

A sharded-lock, two-level LRU map: block key -> small LRU of pod entries (pod, dp rank, tier), each with
the number of physical copies the pod announced. Pure and synchronous: no sockets, clocks or threads of
its own (locks only, so readers and writers on different threads are safe). This module is the facade
(entry interning, batch validation and routing, lookups, views); the shards themselves are shard.py.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Collection, Iterable, Sequence

import msgspec
from kvindex.indexer import compiled
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, PodRef
from kvindex.indexer.shard import (
    CHECK_PARENT,
    CLEAR,
    MAX_COPIES,
    NUM_COUNTS,
    REMOVE,
    STORE,
    HolderIds,
    KeyGroup,
    Shard,
    ShardCore,
    Step,
)

__all__ = ["MAX_COPIES", "ApplyStats", "Entry", "HolderIds", "Holders", "KVIndex"]

# One pod entry: a pod (with its dp rank) holding blocks on one tier.
Entry = tuple[PodRef, str]
# For each prompt block, who holds it: ((pod, tier), ...). Lookups stop at the first block nobody holds.
Holders = tuple[Entry, ...]


class ApplyStats(msgspec.Struct, frozen=True):
    """What one `KVIndex.apply` call did, for metrics (the index keeps no counters of its own).

    Built positionally from the shards' counter list: the fields are in the order of shard.py's indices.
    """

    stored_blocks: int = 0  # (block, entry) pairs newly added
    refreshed_blocks: int = 0  # re-stores of a pair already held: one more copy, recency refreshed
    removed_blocks: int = 0  # pairs dropped by BlocksRemoved (their last copy went)
    missing_removals: int = 0  # BlocksRemoved for a pair the index did not hold
    cleared_blocks: int = 0  # pairs dropped by AllBlocksCleared
    unknown_parents: int = 0  # BlocksStored whose parent_key this pod held on no tier at that point
    evicted_keys: int = 0  # keys dropped because their shard was full
    evicted_entries: int = 0  # pairs dropped by either LRU level (may belong to other pods)
    released_copies: int = 0  # BlocksRemoved that dropped one of several copies: the pair stays held


_MAX_KEY = 2**64 - 1


def _checked_keys(keys: Sequence[int]) -> array[int]:
    """The keys as an array; refuses anything but unsigned 64-bit ints, before a batch changes anything."""
    try:
        return array("Q", keys)
    except (TypeError, OverflowError) as exc:
        bad = next((key for key in keys if not isinstance(key, int)), None)
        if bad is not None:
            raise TypeError(f"block keys must be ints, got {bad!r}") from exc
        raise ValueError(f"block keys must be unsigned 64-bit ints, got {min(keys)}..{max(keys)}") from exc


def apply_each(
    apply: Callable[[PodRef, Sequence[KVEvent]], ApplyStats],
    batches: Sequence[tuple[PodRef, Sequence[KVEvent]]],
) -> list[ApplyStats | Exception]:
    """`apply` of each (pod, events) in order: its stats, or the exception it raised (the caller's to
    report, with the pod it belongs to); the batches after a failing one are still applied."""
    results: list[ApplyStats | Exception] = []
    for pod, events in batches:
        try:
            results.append(apply(pod, events))
        except Exception as exc:  # handed back per batch, never swallowed
            results.append(exc)
    return results


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

    Memory per (pod, block) pair at 1M pairs, block keys included (benchmarks/index.py): ~37 B on the
    compiled shard core, ~100 B on shard.py's.
    """

    blocking_io = False  # in this process: readers call it directly

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
        # The compiled shard (indexer/_shard.c) when it was built, else shard.py's: same behaviour.
        shard_type = compiled.shard_type
        self._shards: list[ShardCore] = [
            shard_type(self.shard_capacity, max_pods_per_key) for _ in range(num_shards)
        ]
        # One lock per shard (same position), held around every read or write of that shard.
        self._locks = [threading.Lock() for _ in range(num_shards)]
        self.shard_low_water = self._shards[0].low_water
        # Interned entries: ids are small ints, never reused, append-only (readable without the lock).
        self._intern_lock = threading.Lock()
        self._entries: list[Entry] = []
        # The (pod, tier) an id from `lookup_ids` stands for: the list's own lookup, so a score answer
        # resolving ~100 holders makes no Python call per id.
        self.entry: Callable[[int], Entry] = self._entries.__getitem__
        # entry id -> (entry id,): the lookup answer for a single holder, shared instead of allocated.
        self._single_ids: list[HolderIds] = []
        self._entry_ids: dict[Entry, int] = {}
        self._pod_entry_ids: dict[PodRef, frozenset[int]] = {}
        # pod -> tier -> entry id, for the compiled core's apply_events (a pod appears once interned).
        self._pod_tier_entry_ids: dict[PodRef, dict[str, int]] = {}
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
                # A new dict, not an update: a reader holding the old one sees a consistent table.
                self._pod_tier_entry_ids[pod] = {**self._pod_tier_entry_ids.get(pod, {}), tier: entry_id}
                by_id = self._pod_id_entry_ids
                by_id[pod.pod_id] = by_id.get(pod.pod_id, frozenset()) | {entry_id}
            return entry_id

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
            counts = [0] * NUM_COUNTS
            shard = self._shards[0]
            tier_entry_ids = self._pod_tier_entry_ids.get(pod)
            if tier_entry_ids is not None and type(events) in (list, tuple):
                # The compiled core reads the events itself (the same steps); it declines anything the
                # steps below must look at, untouched.
                with self._locks[0]:
                    if shard.apply_events(
                        events,  # type: ignore[arg-type]  # checked: a list or tuple
                        tier_entry_ids,
                        self._pod_entry_ids[pod],
                        counts,
                        BlocksStored,
                        BlocksRemoved,
                        AllBlocksCleared,
                    ):
                        return ApplyStats(*counts)
            steps = self._validate(pod, events)
            pod_entry_ids = self._pod_entry_ids.get(pod, frozenset())
            with self._locks[0]:
                shard.apply_steps(steps, pod_entry_ids, counts)
            return ApplyStats(*counts)
        return self._apply_sharded(pod, events)

    def apply_many(self, batches: Sequence[tuple[PodRef, Sequence[KVEvent]]]) -> list[ApplyStats | Exception]:
        """`apply` of each (pod, events) in order: per batch its ApplyStats, or the exception its `apply`
        raised (that batch is left out, the others go on, as separate `apply` calls would).

        On the compiled core the batches it reads are applied in one call whose table work runs without the
        GIL (a worker's drain: one batch per pod it heard from), so the poller's Python work goes on on the
        other core meanwhile. A batch it declines (a pod or tier seen for the first time, anything the
        facade must look at) takes `apply`, in its place in the order. Should the core itself fail (memory
        exhaustion), each batch of that call gets the exception: some may be partly applied, as a failed
        `apply` may be.
        """
        if self.num_shards != 1 or type(self._shards[0]) is Shard:  # the reference declines every batch
            return apply_each(self.apply, batches)
        results: list[ApplyStats | Exception] = []
        shard, lock = self._shards[0], self._locks[0]
        tier_entry_ids_of, pod_entry_ids_of = self._pod_tier_entry_ids, self._pod_entry_ids
        done = 0
        while done < len(batches):
            readable: list[tuple[Sequence[KVEvent], dict[str, int], frozenset[int], list[int]]] = []
            for pod, events in batches[done:]:
                tier_entry_ids = tier_entry_ids_of.get(pod)
                if tier_entry_ids is None or type(events) not in (list, tuple):
                    break
                readable.append((events, tier_entry_ids, pod_entry_ids_of[pod], [0] * NUM_COUNTS))
            if readable:
                try:
                    with lock:
                        applied = shard.apply_many(readable, BlocksStored, BlocksRemoved, AllBlocksCleared)
                except Exception as exc:  # the core failed: memory exhaustion
                    results.extend(exc for _ in readable)
                    done += len(readable)
                    continue
                results.extend(ApplyStats(*counts) for _, _, _, counts in readable[:applied])
                done += applied
            if done < len(batches):
                results.extend(apply_each(self.apply, batches[done : done + 1]))
                done += 1
        return results

    def _validate(self, pod: PodRef, events: Iterable[KVEvent]) -> list[Step]:
        """The batch as one shard's steps, in event order; raises before anything changes.

        Consecutive BlocksStored of one tier whose parent is the previous event's last block (a chain
        continued, the usual shape) merge into one store step of one key group: that parent is held at
        that point. Each group's keys are checked once, as one array, when the batch has been read.
        """
        steps: list[Step] = []
        tier_entry_ids: dict[str, int] = {}
        # Each store step's key list, filled while the chain continues, and its (still empty) groups.
        runs: list[tuple[list[int], list[KeyGroup]]] = []
        last_run: list[int] | None = None  # the previous step's keys, if it is a store
        last_entry_id = last_key = -1
        for event in events:
            if isinstance(event, BlocksStored):
                tier = event.tier
                entry_id = tier_entry_ids.get(tier)
                if entry_id is None:
                    entry_id = tier_entry_ids[tier] = self._intern(pod, tier)
                keys = event.block_keys
                parent_key = event.parent_key
                if parent_key is not None:
                    if last_run is not None and parent_key == last_key and entry_id == last_entry_id:
                        if keys:
                            last_run.extend(keys)
                            last_key = keys[-1]
                        continue
                    if type(parent_key) is not int or not 0 <= parent_key <= _MAX_KEY:
                        _checked_keys((parent_key,))  # raises, saying what is wrong
                    steps.append((CHECK_PARENT, parent_key))
                if keys:
                    last_run = list(keys)
                    groups: list[KeyGroup] = []
                    runs.append((last_run, groups))
                    last_entry_id, last_key = entry_id, keys[-1]
                    steps.append((STORE, entry_id, groups))
                else:
                    last_run = None
                continue
            last_run = None
            if isinstance(event, BlocksRemoved):
                entry_id = self._intern(pod, event.tier)
                keys = event.block_keys
                _checked_keys(keys)
                if keys:
                    steps.append((REMOVE, entry_id, keys))
            elif isinstance(event, AllBlocksCleared):
                steps.append((CLEAR,))
            else:
                raise TypeError(f"not a KV event: {type(event).__name__}")
        for run, groups in runs:
            groups.append((run, _checked_keys(run)))
        return steps

    def _apply_sharded(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats:
        num_shards = self.num_shards
        # Shard -> its part of the batch, in event order; only shards the batch touches appear.
        shard_steps: dict[int, list[Step]] = {}
        for step in self._validate(pod, events):
            if step[0] == CLEAR:
                for shard_no in range(num_shards):
                    shard_steps.setdefault(shard_no, []).append(step)
            elif step[0] == CHECK_PARENT:
                shard_steps.setdefault(step[1] % num_shards, []).append(step)
            else:
                # One key list per shard this step touches (no per-block tuples).
                all_keys: list[Sequence[int]]
                if step[0] == STORE:
                    all_keys = [keys for keys, _ in step[2]]
                else:
                    all_keys = [step[2]]
                buckets: dict[int, list[int]] = {}
                for keys in all_keys:
                    for key in keys:
                        bucket = buckets.get(key % num_shards)
                        if bucket is None:
                            buckets[key % num_shards] = [key]
                        else:
                            bucket.append(key)
                entry_id = step[1]
                for shard_no, bucket in buckets.items():
                    part: Step
                    if step[0] == STORE:
                        group: KeyGroup = (bucket, array("Q", bucket))
                        part = (STORE, entry_id, [group])
                    else:
                        part = (REMOVE, entry_id, bucket)
                    shard_steps.setdefault(shard_no, []).append(part)
        counts = [0] * NUM_COUNTS
        pod_entry_ids = self._pod_entry_ids.get(pod, frozenset())
        shards = self._shards
        locks = self._locks
        for shard_no, steps in shard_steps.items():
            with locks[shard_no]:
                shards[shard_no].apply_steps(steps, pod_entry_ids, counts)
        return ApplyStats(*counts)

    def clear_pod(self, pod: PodRef) -> int:
        """Drop every entry of one pod, all tiers (cost: that pod's blocks); returns how many were dropped."""
        entry_ids = self._pod_entry_ids.get(pod)
        if not entry_ids:
            return 0
        cleared = 0
        for shard, lock in zip(self._shards, self._locks, strict=True):
            with lock:
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
        shards = self._shards
        locks = self._locks
        for lock in locks:
            lock.acquire()
        try:
            if len(shards) == 1:
                shards[0].lookup_run(block_keys, single_ids, result)
            else:
                num_shards = len(shards)
                append = result.append
                for key in block_keys:
                    ids = shards[key % num_shards].ids_of(key, single_ids)
                    if ids is None:
                        break
                    append(ids)
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

    def _sum_shards(self, count: Callable[[ShardCore], int]) -> int:
        # NOTE: each read takes the shard's lock: a compiled store of a long batch runs without the GIL,
        # and a pure one is not a single GIL step either, so an unlocked count could see half a batch.
        total = 0
        for shard, lock in zip(self._shards, self._locks, strict=True):
            with lock:
                total += count(shard)
        return total

    def num_keys(self) -> int:
        return self._sum_shards(lambda shard: shard.num_keys())

    def num_entries(self) -> int:
        """(block, pod entry) pairs held, counting a block once per pod and tier (not per copy)."""
        return self._sum_shards(lambda shard: shard.live_total())

    def pod_block_count(self, pod: PodRef, tier: str | None = None) -> int:
        """Blocks one pod holds, counted once per tier (or on `tier` only), not per copy."""
        entry_ids = [
            entry_id
            for entry_id in self._pod_entry_ids.get(pod, ())
            if tier is None or self._entries[entry_id][1] == tier
        ]
        return self._sum_shards(lambda shard: sum(shard.live_of(entry_id) for entry_id in entry_ids))

    def pod_block_counts(self) -> dict[PodRef, int]:
        """Every pod's blocks (all tiers, not per copy), each shard read once under its lock: /v1/pods
        over 1,000 pods took each lock 1,000 times, each a wait behind ingest's stores."""
        pods = list(self._pod_entry_ids.items())
        counts = dict.fromkeys([pod for pod, _ in pods], 0)
        for shard, lock in zip(self._shards, self._locks, strict=True):
            live_of = shard.live_of
            with lock:
                for pod, entry_ids in pods:
                    counts[pod] += sum([live_of(entry_id) for entry_id in entry_ids])
        return counts

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
        for shard, lock in zip(self._shards, self._locks, strict=True):
            with lock:
                for key, copies in shard.copies_by_key():
                    result[key] = {entries[i]: count for i, count in copies.items()}
        return result

    def check_consistency(self) -> list[str]:
        """Violations of the index's invariants (empty when sound): caps, shard routing, reverse map."""
        problems: list[str] = []
        for shard_no, (shard, lock) in enumerate(zip(self._shards, self._locks, strict=True)):
            with lock:
                problems.extend(shard.problems(shard_no, self.num_shards))
        return problems
