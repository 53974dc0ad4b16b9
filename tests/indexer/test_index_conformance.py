"""One conformance suite for the index stores (the in-memory KVIndex and the Redis store on a real
redis-server and on a real 3-node Redis Cluster), run over several shard counts and capacities.

Expected values come from the event rules (each store adds a copy, each remove drops one copy of one tier,
clear drops the pod, the least recently stored key / entry goes first), never from the index's own output.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import pytest
from index_cores import using_core
from kvindex.indexer.events import (
    TIER_CPU,
    TIER_GPU,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    PodRef,
)
from kvindex.indexer.index import KVIndex
from kvindex.indexer.store import Store

pytestmark = pytest.mark.timeout(60)

POD_A = PodRef("a")
POD_B = PodRef("b")
POD_A1 = PodRef("a", dp_rank=1)

CONFIGS = {
    "1-shard-large": dict(num_shards=1, max_keys=1_000_000, max_pods_per_key=256),
    "16-shards-large": dict(num_shards=16, max_keys=1_000_000, max_pods_per_key=256),
    "1-shard-tiny": dict(num_shards=1, max_keys=8, max_pods_per_key=2),
    "16-shards-tiny": dict(num_shards=16, max_keys=64, max_pods_per_key=2),
    # A power-of-256 count: the Redis store cuts shard names from the keys' bytes (16 computes them).
    "256-shards-tiny": dict(num_shards=256, max_keys=1024, max_pods_per_key=2),
}


# "memory" is KVIndex on the compiled shard core, "memory-pure" on shard.py's reference.
STORES = ("memory", "memory-pure", "redis", "redis-cluster")


@pytest.fixture(params=[(store, config) for store in STORES for config in sorted(CONFIGS)], ids="-".join)
def index(request: pytest.FixtureRequest) -> Iterator[Store]:
    store, config = request.param
    if store in ("memory", "memory-pure"):
        with using_core("compiled" if store == "memory" else "pure"):
            yield KVIndex(**CONFIGS[config])
        return
    from kvindex.indexer.stores.redis_store import RedisStore, connect

    # A generous timeout: the 1-shard-large cases store a million keys in one script call.
    url = request.getfixturevalue("redis_cluster_url" if store == "redis-cluster" else "redis_url")
    client = connect(url, socket_timeout_s=120)
    yield RedisStore(client, "model-x", **CONFIGS[config])
    client.close()


def stored(keys: Sequence[int], parent: int | None = None, tier: str = TIER_GPU) -> BlocksStored:
    return BlocksStored(block_keys=tuple(keys), parent_key=parent, token_ids=(), block_size=16, tier=tier)


def removed(keys: Sequence[int], tier: str = TIER_GPU) -> BlocksRemoved:
    return BlocksRemoved(block_keys=tuple(keys), tier=tier)


def same_shard_keys(index: Store, count: int, start: int = 1000) -> list[int]:
    """`count` keys that all land in one shard, so they compete for one key LRU."""
    target = index.shard_of(start)
    return [
        key for key in range(start, start + count * index.num_shards * 4) if index.shard_of(key) == target
    ][:count]


def spread_keys(index: Store, count: int, start: int = 5000) -> list[int]:
    """`count` keys, at most shard_capacity per shard, so nothing is evicted."""
    per_shard: dict[int, int] = {}
    keys = []
    key = start
    while len(keys) < count:
        shard = index.shard_of(key)
        if per_shard.get(shard, 0) < index.shard_capacity:
            per_shard[shard] = per_shard.get(shard, 0) + 1
            keys.append(key)
        key += 1
    return keys


def holders_of(index: Store, key: int) -> set[tuple[PodRef, str]]:
    found = index.lookup([key])
    return set(found[0]) if found else set()


class TestKVIndexConformance:
    def test_store_then_lookup_lists_every_block(self, index: Store) -> None:
        keys = spread_keys(index, 3)
        stats = index.apply(POD_A, [stored(keys)])
        assert stats.stored_blocks == 3
        assert index.lookup(keys) == [((POD_A, TIER_GPU),)] * 3
        assert index.num_keys() == 3 and index.num_entries() == 3
        assert index.pod_block_count(POD_A) == 3
        assert index.pods() == [POD_A]
        assert index.check_consistency() == []

    def test_remove_drops_only_that_tier(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys, tier=TIER_GPU), stored(keys, tier=TIER_CPU)])
        stats = index.apply(POD_A, [removed(keys[:1], tier=TIER_GPU)])
        assert stats.removed_blocks == 1 and stats.missing_removals == 0
        assert holders_of(index, keys[0]) == {(POD_A, TIER_CPU)}
        assert holders_of(index, keys[1]) == {(POD_A, TIER_GPU), (POD_A, TIER_CPU)}
        assert index.pod_block_count(POD_A, TIER_GPU) == 1
        assert index.pod_block_count(POD_A, TIER_CPU) == 2
        assert index.pod_block_counts() == {POD_A: 3}  # every tier, each block once per tier
        assert index.check_consistency() == []

    def test_remove_of_unheld_block_is_counted_and_harmless(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys[:1])])
        stats = index.apply(POD_A, [removed(keys, tier=TIER_GPU), removed(keys[:1], tier=TIER_CPU)])
        assert (stats.removed_blocks, stats.missing_removals) == (1, 2)
        assert index.num_keys() == 0 and index.pods() == []

    def test_removing_last_holder_drops_the_key(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys)])
        index.apply(POD_A, [removed(keys)])
        assert index.num_keys() == 0 and index.num_entries() == 0
        assert index.lookup(keys) == []

    def test_clear_pod_leaves_other_pods_untouched(self, index: Store) -> None:
        keys = spread_keys(index, 3)
        index.apply(POD_A, [stored(keys), stored(keys[:2], tier=TIER_CPU)])
        index.apply(POD_B, [stored(keys[2:])])  # at most 2 holders per key: no per-key eviction
        assert index.clear_pod(POD_A) == 5
        assert index.lookup(keys) == []  # block 0 was only pod a's
        assert index.lookup(keys[2:]) == [((POD_B, TIER_GPU),)]
        assert index.pod_block_count(POD_A) == 0 and index.pods() == [POD_B]
        assert index.clear_pod(POD_A) == 0
        assert index.check_consistency() == []

    def test_all_blocks_cleared_event_is_clear_pod_in_batch_order(self, index: Store) -> None:
        keys = spread_keys(index, 3)
        index.apply(POD_B, [stored(keys)])
        stats = index.apply(POD_A, [stored(keys), AllBlocksCleared(), stored(keys[:1])])
        assert stats.cleared_blocks == 3
        assert holders_of(index, keys[0]) == {(POD_A, TIER_GPU), (POD_B, TIER_GPU)}
        assert holders_of(index, keys[2]) == {(POD_B, TIER_GPU)}

    def test_dp_ranks_are_separate_pods(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys)])
        index.apply(POD_A1, [stored(keys[:1])])
        assert holders_of(index, keys[0]) == {(POD_A, TIER_GPU), (POD_A1, TIER_GPU)}
        index.apply(POD_A1, [AllBlocksCleared()])
        assert holders_of(index, keys[0]) == {(POD_A, TIER_GPU)}
        assert index.pods() == [POD_A]

    def test_key_eviction_drops_least_recently_stored(self, index: Store) -> None:
        capacity = index.shard_capacity
        keys = same_shard_keys(index, capacity + 1)
        index.apply(POD_A, [stored(keys[:capacity])])
        index.apply(POD_B, [stored(keys[:1])])  # re-storing key 0 makes key 1 the oldest
        stats = index.apply(POD_A, [stored(keys[capacity:])])
        # Over capacity, a shard drops its oldest keys down to its low-water mark (the capacity minus
        # 1/64th, so exactly one key below 64): here keys 1, 2, ... in store order.
        num_evicted = capacity + 1 - index.shard_low_water
        assert num_evicted == (1 if capacity < 64 else 1 + capacity // 64)
        assert stats.evicted_keys == num_evicted and stats.evicted_entries == num_evicted
        assert holders_of(index, keys[1]) == set()
        assert holders_of(index, keys[num_evicted]) == set()
        if num_evicted + 1 < capacity:
            assert holders_of(index, keys[num_evicted + 1]) == {(POD_A, TIER_GPU)}
        assert holders_of(index, keys[0]) == {(POD_A, TIER_GPU), (POD_B, TIER_GPU)}
        assert holders_of(index, keys[capacity]) == {(POD_A, TIER_GPU)}
        assert index.pod_block_count(POD_A) == capacity + 1 - num_evicted
        assert index.check_consistency() == []

    def test_lookup_does_not_refresh_recency(self, index: Store) -> None:
        capacity = index.shard_capacity
        keys = same_shard_keys(index, capacity + 1)
        index.apply(POD_A, [stored(keys[:capacity])])
        for _ in range(3):
            index.lookup(keys[:1])
        index.apply(POD_A, [stored(keys[capacity:])])
        assert holders_of(index, keys[0]) == set()

    def test_per_key_entry_cap_drops_least_recently_stored_entry(self, index: Store) -> None:
        cap = index.max_pods_per_key
        pods = [PodRef(f"p{i}") for i in range(cap + 1)]
        (key,) = spread_keys(index, 1)
        for pod in pods[:cap]:
            index.apply(pod, [stored([key])])
        index.apply(pods[0], [stored([key])])  # refresh: pods[1] is now the oldest holder
        stats = index.apply(pods[cap], [stored([key])])
        assert stats.evicted_entries == 1
        expected = {(pod, TIER_GPU) for pod in pods if pod != pods[1]}
        assert holders_of(index, key) == expected
        assert index.pod_block_count(pods[1]) == 0
        assert index.check_consistency() == []

    def test_restore_refreshes_without_duplicating(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys)])
        stats = index.apply(POD_A, [stored(keys)])
        assert (stats.stored_blocks, stats.refreshed_blocks) == (0, 2)
        assert index.num_entries() == 2

    def test_each_copy_needs_its_own_removal(self, index: Store) -> None:
        # vLLM keeps identical blocks apart (a fully cached block-aligned prompt recomputes its last
        # block): one BlocksStored per physical copy, later one BlocksRemoved per copy evicted.
        (key,) = spread_keys(index, 1)
        index.apply(POD_A, [stored([key])])
        stats = index.apply(POD_A, [stored([key])])
        assert (stats.stored_blocks, stats.refreshed_blocks) == (0, 1)
        stats = index.apply(POD_A, [removed([key])])
        assert (stats.removed_blocks, stats.released_copies, stats.missing_removals) == (0, 1, 0)
        assert holders_of(index, key) == {(POD_A, TIER_GPU)}
        assert index.num_entries() == 1 and index.pod_block_count(POD_A) == 1
        stats = index.apply(POD_A, [removed([key])])
        assert (stats.removed_blocks, stats.released_copies) == (1, 0)
        assert holders_of(index, key) == set() and index.num_keys() == 0
        stats = index.apply(POD_A, [removed([key])])
        assert stats.missing_removals == 1
        assert index.check_consistency() == []

    def test_copies_are_counted_per_pod_and_tier(self, index: Store) -> None:
        (key,) = spread_keys(index, 1)  # at most 2 holders at once: no per-key eviction
        index.apply(POD_A, [stored([key]), stored([key])])
        index.apply(POD_B, [stored([key])])
        index.apply(POD_B, [removed([key])])  # b's only copy
        index.apply(POD_A, [stored([key], tier=TIER_CPU)])
        index.apply(POD_A, [removed([key], tier=TIER_CPU), removed([key])])  # one of a's two GPU copies
        assert holders_of(index, key) == {(POD_A, TIER_GPU)}
        index.apply(POD_A, [removed([key])])
        assert holders_of(index, key) == set()
        assert index.check_consistency() == []

    def test_clear_drops_every_copy(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys), stored(keys[:1]), stored(keys[:1])])
        index.apply(POD_B, [stored(keys[:1])])
        assert index.clear_pod(POD_A) == 2  # pairs, not copies
        assert holders_of(index, keys[0]) == {(POD_B, TIER_GPU)}
        index.apply(POD_B, [stored(keys[:1]), AllBlocksCleared(), stored(keys[1:])])
        index.apply(POD_B, [removed(keys[1:])])
        assert index.num_keys() == 0 and index.check_consistency() == []

    def test_lookup_answers_follow_every_write(self, index: Store) -> None:
        # Multi-holder answers may be cached between writes: each kind of write must show at once.
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys)])
        index.apply(POD_B, [stored(keys)])
        assert [set(h) for h in index.lookup(keys)] == [{(POD_A, TIER_GPU), (POD_B, TIER_GPU)}] * 2
        index.apply(POD_A1, [stored(keys[:1])])  # a third holder: the per-key cap (2) may drop one
        expected = {(POD_A, TIER_GPU), (POD_B, TIER_GPU), (POD_A1, TIER_GPU)}
        if index.max_pods_per_key == 2:
            expected.discard((POD_A, TIER_GPU))
        assert set(index.lookup(keys[:1])[0]) == expected
        index.apply(POD_B, [removed(keys)])
        assert set(index.lookup(keys)[0]) == expected - {(POD_B, TIER_GPU)}
        assert index.lookup(keys[1:]) == [((POD_A, TIER_GPU),)]
        index.clear_pod(POD_A1)
        index.apply(POD_B, [stored(keys[:1], tier=TIER_CPU)])
        assert set(index.lookup(keys[:1])[0]) == expected - {(POD_B, TIER_GPU), (POD_A1, TIER_GPU)} | {
            (POD_B, TIER_CPU)
        }
        assert index.check_consistency() == []

    def test_reverse_map_stays_consistent_under_both_evictions(self, index: Store) -> None:
        pods = [PodRef(f"p{i}", dp_rank=i % 2) for i in range(6)]
        for round_no in range(4):
            for pod_no, pod in enumerate(pods):
                keys = [round_no * 7 + pod_no * 3 + k for k in range(min(index.shard_capacity, 30) + 3)]
                index.apply(pod, [stored(keys, tier=(TIER_GPU, TIER_CPU)[pod_no % 2])])
            index.apply(pods[round_no], [removed(range(40))])
        assert index.check_consistency() == []
        snapshot = index.snapshot()
        for pod in pods:
            held = sum(1 for holders in snapshot.values() for p, _ in holders if p == pod)
            assert index.pod_block_count(pod) == held
        counts = index.pod_block_counts()
        assert {pod: n for pod, n in counts.items() if n} == {
            pod: index.pod_block_count(pod) for pod in index.pods()
        }
        assert set(counts) <= set(pods)
        for pod in pods:
            held = index.pod_block_count(pod)
            assert index.clear_pod(pod) == held
        assert index.num_keys() == 0 and index.num_entries() == 0
        assert index.check_consistency() == []

    def test_lookup_stops_at_first_gap(self, index: Store) -> None:
        keys = spread_keys(index, 4)
        index.apply(POD_A, [stored(keys[:2]), stored(keys[3:])])
        assert index.lookup(keys) == [((POD_A, TIER_GPU),)] * 2
        assert index.lookup(keys[3:]) == [((POD_A, TIER_GPU),)]

    def test_lookup_reads_keys_packed_as_unsigned_64_bit(self, index: Store) -> None:
        """The score path passes a prompt's keys as array('Q') (BlockHasher.event_key_array): the same
        answers as a list of ints, including keys past 2**63 and the stop at the first gap."""
        keys = spread_keys(index, 6, start=2**63 - 3)  # on both sides of 2**63
        index.apply(POD_A, [stored(keys[:2]), stored(keys[3:])])
        index.apply(POD_B, [stored(keys[:1])])
        for probe in (keys, keys[3:], keys[2:], []):
            assert index.lookup_ids(array("Q", probe)) == index.lookup_ids(probe)
            assert index.lookup(array("Q", probe)) == index.lookup(probe)
        assert len(index.lookup(array("Q", keys[3:]))) == 3
        assert index.lookup(array("Q", keys), pods=["b"]) == [((POD_B, TIER_GPU),)]

    def test_pods_filter_restricts_holders_and_the_stop(self, index: Store) -> None:
        keys = spread_keys(index, 3)
        index.apply(POD_A, [stored(keys[:2])])
        index.apply(POD_A1, [stored(keys[:1], tier=TIER_CPU)])
        index.apply(POD_B, [stored(keys[1:])])
        assert len(index.lookup(keys)) == 3
        assert [set(h) for h in index.lookup(keys, pods=["a"])] == [
            {(POD_A, TIER_GPU), (POD_A1, TIER_CPU)},
            {(POD_A, TIER_GPU)},
        ]
        assert index.lookup(keys, pods=["b"]) == []
        assert index.lookup(keys[1:], pods=["b", "nobody"]) == [((POD_B, TIER_GPU),)] * 2
        assert index.lookup(keys, pods=["nobody"]) == []
        assert index.lookup(keys, pods=[]) == []

    def test_unknown_parents_are_applied_and_counted(self, index: Store) -> None:
        keys = spread_keys(index, 6)
        index.apply(POD_B, [stored(keys[:1])])
        stats = index.apply(
            POD_A,
            [
                stored(keys[1:2], parent=keys[0]),  # held by b only: unknown for a
                stored(keys[2:3], parent=keys[1]),  # stored earlier in this batch: known
                stored(keys[3:4], parent=None),  # a root: never unknown
                stored(keys[4:5], parent=keys[3], tier=TIER_CPU),  # held on another tier: known
            ],
        )
        assert stats.unknown_parents == 1 and stats.stored_blocks == 4
        stats = index.apply(POD_A, [removed(keys[2:3]), stored(keys[5:6], parent=keys[2])])
        assert stats.unknown_parents == 1  # removed earlier in the same batch
        assert holders_of(index, keys[5]) == {(POD_A, TIER_GPU)}

    def test_bad_batch_raises_and_changes_nothing(self, index: Store) -> None:
        keys = spread_keys(index, 2)
        index.apply(POD_A, [stored(keys)])
        before = index.snapshot()
        with pytest.raises(TypeError):
            index.apply(POD_B, [stored(keys), "not an event"])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            index.apply(POD_B, [stored(keys), stored([-1])])
        with pytest.raises(TypeError):
            index.apply(POD_B, [stored(keys), stored(["x"])])  # type: ignore[list-item]
        assert index.snapshot() == before

    def test_a_known_pods_bad_batch_raises_and_changes_nothing_and_a_new_tier_is_taken(
        self, index: Store
    ) -> None:
        # The compiled core reads a known pod's events itself and declines what it cannot take; the
        # facade then refuses the batch as a whole, or (a tier the pod has not used yet) applies it.
        keys = spread_keys(index, 4)
        index.apply(POD_A, [stored(keys[:1])])
        before = index.snapshot()
        bad_batches: list[list[object]] = [
            [stored(keys[1:2]), stored([2**64])],
            [stored(keys[1:2]), "not an event"],
            [removed(keys[:1]), stored([-5])],
            [stored(keys[1:2], parent=keys[0]), stored(keys[2:3], parent=-1)],
        ]
        for bad in bad_batches:
            with pytest.raises((TypeError, ValueError)):
                index.apply(POD_A, bad)  # type: ignore[arg-type]
        assert index.snapshot() == before
        stats = index.apply(
            POD_A, [stored(keys[1:2], parent=keys[0]), stored(keys[2:4], parent=keys[1], tier=TIER_CPU)]
        )
        assert stats.stored_blocks == 3 and stats.unknown_parents == 0  # the parent is held (on GPU)
        assert holders_of(index, keys[3]) == {(POD_A, TIER_CPU)}
        assert holders_of(index, keys[1]) == {(POD_A, TIER_GPU)}


def test_invalid_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        KVIndex(num_shards=0)
    with pytest.raises(ValueError):
        KVIndex(max_pods_per_key=0)
