"""The block index's shards: the keys of one lock each (used by indexer/index.py only).

A shard is the mechanism under `KVIndex`: the key LRU (block key -> holders), each key's holder LRU with
copy counts, and per entry a reverse log of the keys it stored. It knows entry ids, never pods or tiers,
and holds no lock: the facade interns entries, validates batches, routes them here and holds each shard's
lock, so this module stays free of threads.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Final, Literal, Protocol

from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

# The lookup answer for one key: the entry ids holding it (resolve with KVIndex.entry).
HolderIds = tuple[int, ...]

# NOTE: a key's holders are a bare entry id while one entry holds it with one copy (the common case: most
# blocks live on one pod, once), else a dict entry_id -> copies, insertion-ordered as the per-key LRU. A
# dict holder has >= 2 entries or one entry with >= 2 copies (it is folded back to an int otherwise).
# Small dicts of ints are not tracked by the garbage collector, so the index adds no GC work.
# NOTE: code tells them apart with `type(held) is int` and `type(held) is dict`, each narrowed by mypy (an
# `else` after one of them stays a union); a missing key (None) fails both. isinstance narrows both ways
# but costs more per key on these loops; the read loop (Shard.lookup_run) skips the second check.
KeyHolders = int | dict[int, int]

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

# A store's keys, and the same as an array (checked unsigned 64-bit, appended to the reverse-map log).
KeyGroup = tuple[Sequence[int], "array[int]"]


# One step of a batch, routed to shards: a plain tuple whose first item says which kind it is. mypy
# narrows the union on `step[0] == STORE` (and so on), so each kind keeps its own item types.
# NOTE: tuples, not small classes or NamedTuples: the facade builds one step per event (removals are not
# merged) and per shard a step touches, and a Python-level constructor per step is measurable on
# removal-heavy batches; a tuple display is built in C.
STORE: Final = 0
REMOVE: Final = 1
CHECK_PARENT: Final = 2
CLEAR: Final = 3
# (STORE, entry id, key groups): store each group's keys in order (consecutive events of one entry).
Store = tuple[Literal[0], int, list[KeyGroup]]
# (REMOVE, entry id, keys): drop one copy of each key.
Remove = tuple[Literal[1], int, Sequence[int]]
# (CHECK_PARENT, parent key): count an unknown parent if the batch's pod holds it on no tier by now.
CheckParent = tuple[Literal[2], int]
# (CLEAR,): drop every pair of the batch's pod (AllBlocksCleared).
Clear = tuple[Literal[3]]
Step = Store | Remove | CheckParent | Clear


# Indices into the mutable counter list a batch accumulates into (same order as ApplyStats' fields in
# indexer/index.py, which is built from it).
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
NUM_COUNTS = 9


class ShardCore(Protocol):
    """What KVIndex asks of a shard: the pure `Shard` below (the reference) or the compiled
    kvindex.indexer._shard.Shard (indexer/_shard.c), chosen by indexer/compiled.py."""

    @property
    def capacity(self) -> int: ...

    @property
    def low_water(self) -> int: ...

    @property
    def max_pods_per_key(self) -> int: ...

    def apply_steps(
        self, steps: Sequence[Step], pod_entry_ids: frozenset[int], counts: list[int], /
    ) -> None: ...

    def apply_events(
        self,
        events: Sequence[KVEvent],
        tier_entry_ids: dict[str, int],
        pod_entry_ids: frozenset[int],
        counts: list[int],
        stored_type: type[BlocksStored],
        removed_type: type[BlocksRemoved],
        cleared_type: type[AllBlocksCleared],
        /,
    ) -> bool:
        """Apply one batch of a pod's events straight from the event objects (the same steps as the
        facade's `_validate` would make), or decline it untouched (False): the facade then makes the
        steps itself. `tier_entry_ids`: the pod's entry id per tier (a tier not in it declines)."""
        ...

    def apply_many(
        self,
        batches: list[tuple[Sequence[KVEvent], dict[str, int], frozenset[int], list[int]]],
        stored_type: type[BlocksStored],
        removed_type: type[BlocksRemoved],
        cleared_type: type[AllBlocksCleared],
        /,
    ) -> int:
        """apply_events of each (events, tier_entry_ids, pod_entry_ids, counts) in order, as one call (the
        compiled core does the table work of all of them without the GIL); stops at the first batch it
        declines and returns how many it applied (the facade applies that one its own way)."""
        ...

    def clear_entries(self, entry_ids: Iterable[int], /) -> int: ...

    def lookup_run(
        self, block_keys: Sequence[int], single_ids: list[HolderIds], out: list[HolderIds], /
    ) -> None: ...

    def ids_of(self, block_key: int, single_ids: list[HolderIds], /) -> HolderIds | None: ...

    def num_keys(self) -> int: ...

    def live_of(self, entry_id: int, /) -> int: ...

    def live_total(self) -> int: ...

    def copies_by_key(self) -> Iterable[tuple[int, dict[int, int]]]: ...

    def problems(self, shard_no: int, num_shards: int, /) -> list[str]: ...


class Shard:
    """One shard of the index: the key LRU and, per entry, a log of the keys it stored here."""

    __slots__ = (
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
        # Block key -> holders; a plain dict is insertion-ordered, so it is the key LRU (least recently
        # *stored* first; a store re-inserts, reads never move anything). An OrderedDict would cost ~75 B
        # more per key.
        self.holders: dict[int, KeyHolders] = {}
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

    # All methods below run with this shard's lock (KVIndex._locks) held.

    # -- the read path and counts (what KVIndex asks of either core: see ShardCore) -------------------

    def lookup_run(
        self, block_keys: Sequence[int], single_ids: list[HolderIds], out: list[HolderIds]
    ) -> None:
        """Append the ids holding each leading key to `out`, stopping at the first key nobody holds.

        `single_ids[e]` is the shared answer `(e,)` for a key one entry holds.
        """
        # NOTE: this loop narrows a dict holder (for mypy) only to freeze it, once per key and write, not
        # on every read with `elif type(held) is dict`: one more check per key is measurable on a long
        # prompt.
        get = self.holders.get
        frozen_get = self.frozen.get
        append = out.append
        for key in block_keys:
            held = get(key)
            if held is None:
                break
            if type(held) is int:
                append(single_ids[held])
            else:
                ids = frozen_get(key)
                if ids is None:
                    assert type(held) is dict  # not an int: a dict holder
                    ids = self.freeze(key, held)
                append(ids)

    def ids_of(self, block_key: int, single_ids: list[HolderIds]) -> HolderIds | None:
        """The ids holding one key, None when nobody does."""
        held = self.holders.get(block_key)
        if held is None:
            return None
        if type(held) is int:
            return single_ids[held]
        ids = self.frozen.get(block_key)
        if ids is None:
            assert type(held) is dict  # not an int: a dict holder
            ids = self.freeze(block_key, held)
        return ids

    def num_keys(self) -> int:
        return len(self.holders)

    def live_of(self, entry_id: int) -> int:
        """Pairs one entry holds in this shard."""
        return self.entry_live.get(entry_id, 0)

    def live_total(self) -> int:
        return sum(list(self.entry_live.values()))

    # -- the write path --------------------------------------------------------------------------------

    def apply_events(
        self,
        events: Sequence[KVEvent],
        tier_entry_ids: dict[str, int],
        pod_entry_ids: frozenset[int],
        counts: list[int],
        stored_type: type[BlocksStored],
        removed_type: type[BlocksRemoved],
        cleared_type: type[AllBlocksCleared],
        /,
    ) -> bool:
        """Always declines: the reference takes the facade's steps (apply_steps)."""
        return False

    def apply_many(
        self,
        batches: list[tuple[Sequence[KVEvent], dict[str, int], frozenset[int], list[int]]],
        stored_type: type[BlocksStored],
        removed_type: type[BlocksRemoved],
        cleared_type: type[AllBlocksCleared],
        /,
    ) -> int:
        """Declines the first batch, as apply_events declines every one."""
        return 0

    def apply_steps(self, steps: Sequence[Step], pod_entry_ids: frozenset[int], counts: list[int]) -> None:
        for step in steps:
            if step[0] == STORE:
                self.store(step[1], step[2], counts)
            elif step[0] == REMOVE:
                self.remove(step[1], step[2], counts)
            elif step[0] == CHECK_PARENT:
                if not self.held_by_any(step[1], pod_entry_ids):
                    counts[_UNKNOWN_PARENT] += 1
            else:
                counts[_CLEARED] += self.clear_entries(pod_entry_ids)

    def store(self, entry_id: int, key_groups: Sequence[KeyGroup], counts: list[int]) -> None:
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
            elif type(held) is dict:  # first: a held key here is mostly a shared prefix block, on many pods
                holder_lru = held
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
            elif type(held) is int:
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
            if type(held) is int:
                live[held] -= 1
                evicted_entries += 1
            elif type(held) is dict:
                self.frozen.pop(key, None)
                for entry_id in held:
                    live[entry_id] -= 1
                evicted_entries += len(held)
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
        if type(held) is int:
            return held == entry_id
        if type(held) is dict:
            return entry_id in held
        return False

    def remove(self, entry_id: int, keys: Sequence[int], counts: list[int]) -> None:
        holders_map = self.holders
        removed = released = 0
        for key in keys:
            held = holders_map.get(key)
            if type(held) is int:
                if held == entry_id:
                    del holders_map[key]
                    removed += 1
            elif type(held) is dict:
                holder_lru = held
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
        if type(held) is int:
            return held in entry_ids
        if type(held) is dict:
            return not entry_ids.isdisjoint(held)
        return False

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
                if type(held) is int:
                    if held == entry_id:
                        del holders_map[key]
                        cleared += 1
                elif type(held) is dict and entry_id in held:
                    holder_lru = held
                    self.frozen.pop(key, None)
                    del holder_lru[entry_id]
                    cleared += 1
                    _fold(holders_map, key, holder_lru)
        return cleared

    # -- whole-shard views, for KVIndex.snapshot_copies and check_consistency (O(shard)) ----------------

    def copies_by_key(self) -> Iterator[tuple[int, dict[int, int]]]:
        """Every key with its holders' copy counts (entry id -> copies), in key LRU order."""
        for key, held in self.holders.items():
            yield key, held if isinstance(held, dict) else {held: 1}

    def problems(self, shard_no: int, num_shards: int) -> list[str]:
        """Violations of this shard's invariants (empty when sound), as shard `shard_no` of `num_shards`.

        The cap, key routing, the holder representation, lookup tuples, reverse logs and live counts.
        """
        problems: list[str] = []
        if len(self.holders) > self.capacity:
            problems.append(f"shard {shard_no}: {len(self.holders)} keys > {self.capacity}")
        live: dict[int, int] = {}
        logged = {entry_id: set(log) for entry_id, log in self.entry_keys.items()}
        for key, held in self.holders.items():
            if key % num_shards != shard_no:
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
                    problems.append(f"shard {shard_no}: key {key} missing from entry {entry_id}'s log")
        for key, ids in self.frozen.items():
            frozen_of = self.holders.get(key)
            if not isinstance(frozen_of, dict) or tuple(frozen_of) != ids:
                problems.append(f"shard {shard_no}: stale lookup tuple for key {key}")
        counted = {entry_id: n for entry_id, n in self.entry_live.items() if n}
        if counted != live:
            problems.append(f"shard {shard_no}: live counts {counted} != held pairs {live}")
        return problems


def _fold(holders_map: dict[int, KeyHolders], key: int, holder_lru: dict[int, int]) -> None:
    """Restore the holder invariant after a pair lost copies (the key keeps its LRU place)."""
    if len(holder_lru) > 1:
        return
    if not holder_lru:
        del holders_map[key]
        return
    ((only, only_copies),) = holder_lru.items()
    if only_copies == 1:
        holders_map[key] = only
