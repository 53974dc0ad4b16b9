"""The index stores (in-memory KVIndex, Redis on a real redis-server) driven by hypothesis against a
reference model written from the event rules.

The model is a plain dict block key -> {(pod, tier): copies}: vLLM announces each physical copy of a
block, so BlocksStored adds one copy of the pod's tier to each key (at most MAX_COPIES), BlocksRemoved
drops one copy and the pair with its last, AllBlocksCleared drops the pod whatever the counts; a stored
block's parent is "unknown" when the pod holds it on no tier at that moment. Unbounded, the index must equal the model exactly; bounded,
it must hold a subset of it and respect its caps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from index_cores import CORES, kv_events, make_index
from kvindex.indexer.events import (
    TIER_CPU,
    TIER_GPU,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    PodRef,
)
from kvindex.indexer.index import MAX_COPIES, KVIndex
from kvindex.indexer.store import Store

pytestmark = pytest.mark.timeout(120)

PODS = [PodRef("a"), PodRef("a", 1), PodRef("b")]
TIERS = [TIER_GPU, TIER_CPU]
KEYS = st.integers(0, 23)

events_strategy = kv_events(KEYS, TIERS)

Model = dict[int, dict[tuple[PodRef, str], int]]


def model_apply(model: Model, pod: PodRef, events: list[KVEvent]) -> int:
    """Apply events to the model; returns the number of unknown parents."""
    unknown_parents = 0
    for event in events:
        if isinstance(event, BlocksStored):
            parent = event.parent_key
            if parent is not None and not any(p == pod for p, _ in model.get(parent, ())):
                unknown_parents += 1
            for key in event.block_keys:
                copies = model.setdefault(key, {})
                copies[(pod, event.tier)] = min(MAX_COPIES, copies.get((pod, event.tier), 0) + 1)
        elif isinstance(event, BlocksRemoved):
            for key in event.block_keys:
                copies = model.get(key, {})
                if (pod, event.tier) in copies:
                    copies[(pod, event.tier)] -= 1
                    if not copies[(pod, event.tier)]:
                        del copies[(pod, event.tier)]
        else:
            for copies in model.values():
                for holder in [h for h in copies if h[0] == pod]:
                    del copies[holder]
    for key in [k for k, holders in model.items() if not holders]:
        del model[key]
    return unknown_parents


# Builds a fresh, empty store: (num_shards, max_keys, max_pods_per_key) -> store.
StoreFactory = Callable[[int, int, int], Store]


def memory_store(num_shards: int, max_keys: int, max_pods_per_key: int) -> Store:
    return KVIndex(num_shards=num_shards, max_keys=max_keys, max_pods_per_key=max_pods_per_key)


def memory_store_on(core: str) -> StoreFactory:
    """KVIndexes on one shard core (compiled or pure)."""

    def make(num_shards: int, max_keys: int, max_pods_per_key: int) -> Store:
        return make_index(core, num_shards, max_keys, max_pods_per_key)

    return make


class UnboundedIndexMatchesModel(RuleBasedStateMachine):
    def __init__(self, make_store: StoreFactory = memory_store) -> None:
        super().__init__()
        self.index = make_store(3, 10_000, 100)
        self.model: Model = {}

    @rule(pod=st.sampled_from(PODS), events=events_strategy)
    def apply(self, pod: PodRef, events: list[KVEvent]) -> None:
        expected_unknown = model_apply(self.model, pod, events)
        assert self.index.apply(pod, events).unknown_parents == expected_unknown

    @rule(pod=st.sampled_from(PODS))
    def clear_pod(self, pod: PodRef) -> None:
        expected = sum(1 for holders in self.model.values() for p, _ in holders if p == pod)
        model_apply(self.model, pod, [AllBlocksCleared()])
        assert self.index.clear_pod(pod) == expected

    @rule(prompt=st.lists(KEYS, max_size=8), pods=st.none() | st.sets(st.sampled_from(["a", "b"])))
    def lookup(self, prompt: list[int], pods: set[str] | None) -> None:
        expected = []
        for key in prompt:
            holders = {h for h in self.model.get(key, ()) if pods is None or h[0].pod_id in pods}
            if not holders:
                break
            expected.append(holders)
        assert [set(h) for h in self.index.lookup(prompt, pods)] == expected

    @invariant()
    def same_content(self) -> None:
        assert self.index.snapshot_copies() == self.model
        assert self.index.check_consistency() == []
        assert self.index.num_entries() == sum(len(v) for v in self.model.values())
        for pod in PODS:
            held = sum(1 for holders in self.model.values() for p, _ in holders if p == pod)
            assert self.index.pod_block_count(pod) == held
        assert self.index.pods() == sorted({p for holders in self.model.values() for p, _ in holders})


class BoundedIndexStaysWithinModelAndCaps(RuleBasedStateMachine):
    def __init__(self, make_store: StoreFactory = memory_store) -> None:
        super().__init__()
        self.index = make_store(2, 6, 2)
        self.model: Model = {}

    @rule(pod=st.sampled_from(PODS), events=events_strategy)
    def apply(self, pod: PodRef, events: list[KVEvent]) -> None:
        model_apply(self.model, pod, events)
        self.index.apply(pod, events)

    @rule(pod=st.sampled_from(PODS))
    def clear_pod(self, pod: PodRef) -> None:
        model_apply(self.model, pod, [AllBlocksCleared()])
        self.index.clear_pod(pod)

    @invariant()
    def subset_of_model_within_caps(self) -> None:
        snapshot = self.index.snapshot()
        assert len(snapshot) <= 6
        for key, holders in snapshot.items():
            assert 1 <= len(holders) <= 2
            assert holders <= self.model.get(key, {}).keys()
        # Evictions drop whole pairs and the stores/removes after them change both sides alike, so the
        # index never counts more copies than the model.
        for key, copies in self.index.snapshot_copies().items():
            for holder, count in copies.items():
                assert count <= self.model[key][holder]
        assert self.index.check_consistency() == []
        for pod in PODS:
            held = sum(1 for holders in snapshot.values() for p, _ in holders if p == pod)
            assert self.index.pod_block_count(pod) == held


MEMORY_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("core", CORES)
def test_unbounded_index_matches_model(core: str) -> None:
    run_state_machine_as_test(
        lambda: UnboundedIndexMatchesModel(memory_store_on(core)), settings=MEMORY_SETTINGS
    )


@pytest.mark.parametrize("core", CORES)
def test_bounded_index_stays_within_model_and_caps(core: str) -> None:
    run_state_machine_as_test(
        lambda: BoundedIndexStaysWithinModelAndCaps(memory_store_on(core)), settings=MEMORY_SETTINGS
    )


# The same machines over the Redis store, with the same settings.
REDIS_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None)


@pytest.fixture
def redis_store_factory(redis_url: str) -> Iterator[StoreFactory]:
    import redis
    from kvindex.indexer.stores.redis_store import RedisStore

    client = redis.Redis.from_url(redis_url)

    def make(num_shards: int, max_keys: int, max_pods_per_key: int) -> Store:
        client.flushall()
        return RedisStore(
            client, "model-x", num_shards=num_shards, max_keys=max_keys, max_pods_per_key=max_pods_per_key
        )

    yield make
    client.close()


def test_unbounded_redis_store_matches_model(redis_store_factory: StoreFactory) -> None:
    run_state_machine_as_test(
        lambda: UnboundedIndexMatchesModel(redis_store_factory), settings=REDIS_SETTINGS
    )


def test_bounded_redis_store_stays_within_model_and_caps(redis_store_factory: StoreFactory) -> None:
    run_state_machine_as_test(
        lambda: BoundedIndexStaysWithinModelAndCaps(redis_store_factory), settings=REDIS_SETTINGS
    )
