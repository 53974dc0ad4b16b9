"""The compiled shard core (indexer/_shard.c) against shard.py's pure-Python reference: the same operations
on a KVIndex of each must give the same answers, the same counts and the same state, LRU order included
at both levels (which key a full shard evicts next, which pod a full key drops next)."""

from __future__ import annotations

import os
import random
from array import array

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from index_cores import kv_events, make_index, require_extension
from kvindex.indexer.events import (
    TIER_CPU,
    TIER_GPU,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    PodRef,
)
from kvindex.indexer.index import KVIndex
from kvindex.indexer.shard import STORE, Shard

pytestmark = pytest.mark.timeout(300)

PODS = [PodRef("a"), PodRef("a", 1), PodRef("b"), PodRef("c")]
TIERS = [TIER_GPU, TIER_CPU]
# Small keys collide often (shared blocks, repeats, removals of held keys); the big ones probe the
# table with the top bit set and the widest value.
KEYS = st.one_of(st.integers(0, 30), st.sampled_from([2**63, 2**63 + 1, 2**64 - 1, 2**32, 12345678901234567]))

events_strategy = kv_events(KEYS, TIERS, max_keys=8, max_events=6)

# (num_shards, max_keys, max_pods_per_key): evictions at both levels, one pod per key, several shards.
CONFIGS = [(1, 6, 2), (1, 5, 1), (3, 12, 3), (2, 4, 1), (1, 10_000, 256), (4, 64, 2)]


def ordered_state(index: KVIndex) -> list[list[tuple[int, list[tuple[int, int]]]]]:
    """Each shard's keys in key-LRU order, each with its (entry id, copies) in holder-LRU order."""
    return [[(key, list(copies.items())) for key, copies in shard.copies_by_key()] for shard in index._shards]


def assert_same(pure: KVIndex, compiled: KVIndex) -> None:
    assert ordered_state(compiled) == ordered_state(pure)
    assert compiled.num_keys() == pure.num_keys()
    assert compiled.num_entries() == pure.num_entries()
    assert compiled.pods() == pure.pods()
    for pod in PODS:
        for tier in (None, *TIERS):
            assert compiled.pod_block_count(pod, tier) == pure.pod_block_count(pod, tier)
    assert pure.check_consistency() == []
    assert compiled.check_consistency() == []


class CoresAgree(RuleBasedStateMachine):
    def __init__(self, config: tuple[int, int, int]) -> None:
        super().__init__()
        self.pure = make_index("pure", *config)
        self.compiled = make_index("compiled", *config)
        self.chains: list[tuple[int, ...]] = []  # every BlocksStored's keys, in the order they were stored

    def remember_chains(self, events: list[KVEvent]) -> None:
        self.chains.extend(event.block_keys for event in events if isinstance(event, BlocksStored))

    @rule(pod=st.sampled_from(PODS), events=events_strategy)
    def apply(self, pod: PodRef, events: list[KVEvent]) -> None:
        assert self.compiled.apply(pod, events) == self.pure.apply(pod, events)
        self.remember_chains(events)

    @rule(batches=st.lists(st.tuples(st.sampled_from(PODS), events_strategy), max_size=6))
    def apply_many(self, batches: list[tuple[PodRef, list[KVEvent]]]) -> None:
        """A worker's drain: the compiled core's one call (table work without the GIL) against the pure
        core's apply of each batch in turn; the same stats per batch and the same state after."""
        pure = [self.pure.apply(pod, events) for pod, events in batches]
        assert self.compiled.apply_many(batches) == pure
        for _, events in batches:
            self.remember_chains(events)

    @rule(data=st.data())
    def lookup_a_stored_chain(self, data: st.DataObject) -> None:
        """A prompt as stored (the compiled lookup follows consecutive nodes), since cut by removals,
        evictions and clears, or grown by other chains."""
        if not self.chains:
            return
        prompt = list(data.draw(st.sampled_from(self.chains)))
        if data.draw(st.booleans()):
            prompt += data.draw(st.sampled_from(self.chains))
        assert self.compiled.lookup_ids(prompt) == self.pure.lookup_ids(prompt)

    @rule(pod=st.sampled_from(PODS))
    def clear_pod(self, pod: PodRef) -> None:
        assert self.compiled.clear_pod(pod) == self.pure.clear_pod(pod)

    @rule(
        prompt=st.lists(KEYS | st.sampled_from([-1, 2**64, 2**70]), max_size=10),
        pods=st.none() | st.sets(st.sampled_from(["a", "b", "c", "z"])),
    )
    def lookup(self, prompt: list[int], pods: set[str] | None) -> None:
        assert self.compiled.lookup_ids(prompt, pods) == self.pure.lookup_ids(prompt, pods)
        assert self.compiled.lookup(prompt, pods) == self.pure.lookup(prompt, pods)

    @invariant()
    def same_state(self) -> None:
        assert_same(self.pure, self.compiled)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_compiled_core_matches_the_pure_core(config: tuple[int, int, int]) -> None:
    require_extension()
    run_state_machine_as_test(
        lambda: CoresAgree(config),
        settings=settings(
            max_examples=120,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_a_lookup_along_a_stored_chain_sees_removed_and_restored_blocks() -> None:
    """The compiled lookup finds a key in the node after the previous key's when it is there: a removed
    block's node keeps its key until reused, and must not be found."""
    require_extension()
    chain = [1000 + number for number in range(12)]
    indexes = [make_index(core) for core in ("pure", "compiled")]
    pure, compiled = indexes

    def same_lookups() -> list[tuple[int, ...]]:
        answers = [index.lookup_ids(chain) for index in indexes]
        assert answers[1] == answers[0]
        return answers[0]

    for index in indexes:
        index.apply(PodRef("a"), [BlocksStored(tuple(chain), None, (), 16, TIER_GPU)])
    assert len(same_lookups()) == 12
    for index in indexes:
        index.apply(PodRef("a"), [BlocksRemoved((chain[4],), TIER_GPU)])
    assert len(same_lookups()) == 4  # the removed block's node still holds its key
    for index in indexes:
        index.apply(PodRef("b"), [BlocksStored((chain[4],), None, (), 16, TIER_GPU)])
    assert same_lookups()[4] == (1,)  # stored again (in the freed node), by b alone
    for index in indexes:
        index.apply(PodRef("a"), [BlocksRemoved((chain[6],), TIER_GPU)])
    assert len(same_lookups()) == 6
    for index in indexes:
        index.apply(PodRef("c"), [BlocksStored((77, 78), None, (), 16, TIER_GPU)])  # reuses chain[6]'s node
        index.apply(PodRef("c"), [BlocksStored((chain[6],), None, (), 16, TIER_GPU)])  # a new node
    answers = same_lookups()
    assert len(answers) == 12 and answers[6] == (2,)
    assert_same(pure, compiled)


def test_large_random_workload_matches_the_pure_core() -> None:
    """Table growth, backward-shift deletions and log compaction at scale: 64-bit random keys, chains
    that share prefixes, removals and clears, on a shard that evicts."""
    require_extension()
    rng = random.Random(14)
    pure = make_index("pure", 2, 40_000, 3)
    compiled = make_index("compiled", 2, 40_000, 3)
    prefixes = [[rng.getrandbits(64) for _ in range(64)] for _ in range(8)]
    held: dict[PodRef, list[int]] = {pod: [] for pod in PODS}
    for step in range(3_000):
        pod = rng.choice(PODS)
        roll = rng.random()
        events: list[KVEvent]
        if roll < 0.6:
            chain = rng.choice(prefixes)[: rng.randint(1, 64)] + [
                rng.getrandbits(64) for _ in range(rng.randint(0, 40))
            ]
            events = [BlocksStored(tuple(chain), None, (), 16, rng.choice(TIERS))]
            held[pod].extend(chain)
        elif roll < 0.95 and held[pod]:
            events = [BlocksRemoved(tuple(rng.sample(held[pod], min(len(held[pod]), 30))), rng.choice(TIERS))]
        elif roll < 0.98:
            events = [AllBlocksCleared()]
            held[pod] = []
        else:
            assert compiled.clear_pod(pod) == pure.clear_pod(pod)
            held[pod] = []
            continue
        assert compiled.apply(pod, events) == pure.apply(pod, events), step
        if step % 50 == 0:
            prompt = rng.choice(prefixes) + [rng.getrandbits(64)]
            assert compiled.lookup_ids(prompt) == pure.lookup_ids(prompt)
            if roll < 0.6:  # the chain just stored, as stored: the compiled lookup follows its nodes
                assert compiled.lookup_ids(chain) == pure.lookup_ids(chain)
    assert_same(pure, compiled)


def test_a_bad_batch_in_a_drain_costs_only_itself() -> None:
    """apply_many: a batch whose apply raises (a key that is not an unsigned 64-bit int) is that batch's
    exception, left out; the batches before and after it are applied, as separate applies would be."""
    require_extension()
    good = [BlocksStored((1, 2, 3), None, (), 16, TIER_GPU)]
    bad: list[KVEvent] = [BlocksStored((4, -5), None, (), 16, TIER_GPU)]
    for core in ("compiled", "pure"):
        index = make_index(core)
        index.apply(PodRef("b"), good)  # known to the index: its next batch takes the compiled read
        outcomes = index.apply_many(
            [(PodRef("a"), good), (PodRef("b"), bad), (PodRef("c"), [*good, BlocksRemoved((2,), TIER_GPU)])]
        )
        assert [type(outcome).__name__ for outcome in outcomes] == ["ApplyStats", "ValueError", "ApplyStats"]
        assert index.snapshot_copies() == {
            1: {(PodRef("a"), TIER_GPU): 1, (PodRef("b"), TIER_GPU): 1, (PodRef("c"), TIER_GPU): 1},
            2: {(PodRef("a"), TIER_GPU): 1, (PodRef("b"), TIER_GPU): 1},
            3: {(PodRef("a"), TIER_GPU): 1, (PodRef("b"), TIER_GPU): 1, (PodRef("c"), TIER_GPU): 1},
        }
        assert index.check_consistency() == []


def test_a_large_drain_matches_the_pure_core() -> None:
    """Drains of 64 pods' 125-key chains (past RELEASE_GIL_KEYS: the table work runs without the GIL),
    shared prefixes, removals and clears among them, on a shard that evicts."""
    require_extension()
    rng = random.Random(64)
    pure = make_index("pure", 1, 60_000, 3)
    compiled = make_index("compiled", 1, 60_000, 3)
    pods = [PodRef(f"pod-{number}") for number in range(100)]
    prefixes = [[rng.getrandbits(64) for _ in range(125)] for _ in range(5)]
    for drain in range(12):
        batches: list[tuple[PodRef, list[KVEvent]]] = []
        for pod in rng.sample(pods, 64):
            roll = rng.random()
            if roll < 0.8:
                chain = rng.choice(prefixes) if roll < 0.3 else [rng.getrandbits(64) for _ in range(125)]
                parent = None if roll < 0.3 else rng.choice(prefixes)[-1]
                batches.append((pod, [BlocksStored(tuple(chain), parent, (), 16, TIER_GPU)]))
            elif roll < 0.95:
                batches.append((pod, [BlocksRemoved(tuple(rng.choice(prefixes)[:40]), TIER_GPU)]))
            else:
                batches.append((pod, [AllBlocksCleared()]))
        assert compiled.apply_many(batches) == [pure.apply(pod, events) for pod, events in batches], drain
    assert_same(pure, compiled)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_compiled_core_frees_what_it_drops() -> None:
    """Stores, shared keys (holder arrays and their cached lookup tuples), removals, evictions and clears,
    over and over: the process must not grow once the first rounds have sized the allocator."""
    shard_type = require_extension()
    keys = list(range(1, 20_001))
    groups = [(keys, array("Q", keys))]
    single_ids = [(entry,) for entry in range(4)]

    def one_round() -> None:
        shard = shard_type(15_000, 2)  # evicts: 20k keys into 15k
        counts = [0] * 9
        for entry in range(3):
            shard.apply_steps([(STORE, entry, groups)], frozenset({entry}), counts)
            out: list[tuple[int, ...]] = []
            shard.lookup_run(keys, single_ids, out)
        shard.apply_steps([(1, 2, keys[:5_000])], frozenset({2}), counts)
        assert shard.clear_entries([0, 1]) > 0
        del shard

    for _ in range(5):
        one_round()
    before = _rss_bytes()
    for _ in range(40):
        one_round()
    assert _rss_bytes() - before < 8 * 2**20


def test_compiled_core_refuses_bad_settings_and_steps() -> None:
    shard_type = require_extension()
    for capacity, max_pods in ((0, 1), (1, 0), (-5, 3)):
        with pytest.raises(ValueError):
            shard_type(capacity, max_pods)
    shard = shard_type(10, 2)
    with pytest.raises(TypeError):
        shard.apply_steps([(9,)], frozenset(), [0] * 9)
    with pytest.raises(TypeError):
        shard.apply_steps([(STORE, 0, [([1, 2], [1, 2])])], frozenset(), [0] * 9)  # not an array('Q')
    with pytest.raises(TypeError):
        shard.apply_steps([(STORE, 0, [([1], array("q", [1]))])], frozenset(), [0] * 9)
    with pytest.raises(OverflowError, match="entry id out of range"):
        shard.apply_steps([(STORE, 2**31, [([1], array("Q", [1]))])], frozenset(), [0] * 9)
    with pytest.raises(OverflowError, match="entry id out of range"):
        shard.clear_entries([2**40])
    assert shard.num_keys() == 0 and shard.problems(0, 1) == []
    # The pure core, for comparison, accepts the same settings as KVIndex does.
    assert Shard(10, 2).low_water == shard.low_water


@pytest.mark.parametrize("core", ["compiled", "pure"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_equal_answers_are_one_tuple_whatever_order_keys_are_first_read_in(
    core: str, num_shards: int
) -> None:
    """A prompt hashed while it is looked up reads its prefix one key per lookup: the answers of a shared
    prefix's keys must still be one tuple per shard (the answer writer finds runs by identity), on both
    cores."""
    index = make_index(core, num_shards=num_shards)
    prefix_a, prefix_b = tuple(range(100, 140)), tuple(range(200, 240))
    for pod in PODS[:3]:
        index.apply(pod, [BlocksStored(block_keys=prefix_a, parent_key=None, token_ids=(), block_size=16)])
    for pod in PODS[1:]:
        index.apply(pod, [BlocksStored(block_keys=prefix_b, parent_key=None, token_ids=(), block_size=16)])
    order = [*prefix_a, *prefix_b]
    random.Random(7).shuffle(order)  # the two prefixes' keys first read interleaved, one per lookup
    for key in order:
        index.lookup_ids((key,))
    for prefix, pods in ((prefix_a, PODS[:3]), (prefix_b, PODS[1:])):
        answers = index.lookup_ids(prefix)
        assert [[index.entry(entry_id)[0] for entry_id in ids] for ids in answers] == [pods] * len(prefix)
        assert len({id(ids) for ids in answers}) == num_shards
    # A write gives its key a fresh answer; the prefix's other keys still share theirs.
    index.apply(
        PODS[3], [BlocksStored(block_keys=prefix_a[5:6], parent_key=None, token_ids=(), block_size=16)]
    )
    answers = index.lookup_ids(prefix_a)
    assert [index.entry(entry_id)[0] for entry_id in answers[5]] == [*PODS[:3], PODS[3]]
    assert len({id(ids) for i, ids in enumerate(answers) if i != 5}) == num_shards
