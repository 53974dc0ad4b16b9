"""KVIndex under concurrent writers and readers: no exceptions, no torn per-key reads, bounded time.

Each writer pod stores (and later removes) its blocks on GPU and CPU *in the same batch*, as two events.
A batch is applied atomically per key (one shard lock hold per batch), so no reader may ever see a writer
pod hold a key on one of the two tiers only.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
from kvindex.indexer.events import TIER_CPU, TIER_GPU, AllBlocksCleared, BlocksRemoved, BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.scorer import score_prefix

# Every KVIndex here is built once on each shard core (tests/indexer/conftest.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("index_core")]

NUM_WRITERS = 4
NUM_READERS = 4
WRITER_BATCHES = 400
READER_LOOKUPS = 300
SHARED_PREFIX = list(range(1, 41))  # every writer stores these: multi-holder keys


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def both_tiers(keys: list[int], parent: int | None) -> list[BlocksStored]:
    return [
        BlocksStored(block_keys=tuple(keys), parent_key=parent, token_ids=(), block_size=16, tier=tier)
        for tier in (TIER_GPU, TIER_CPU)
    ]


def run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish in time"
    return errors


def writer(index: KVIndex, pod: PodRef, seed: int) -> Callable[[], None]:
    def run() -> None:
        rng = random.Random(seed)
        own = [1_000_000 * (seed + 1) + i for i in range(200)]
        for _ in range(WRITER_BATCHES):
            choice = rng.random()
            start = rng.randrange(0, len(SHARED_PREFIX), 8)
            keys = SHARED_PREFIX[start : start + 8] + rng.sample(own, 8)
            if choice < 0.6:
                index.apply(pod, both_tiers(keys, parent=rng.choice([None, *keys])))
            elif choice < 0.95:
                index.apply(pod, [BlocksRemoved(tuple(keys), TIER_GPU), BlocksRemoved(tuple(keys), TIER_CPU)])
            elif choice < 0.98:
                index.apply(pod, [AllBlocksCleared(), *both_tiers(keys, parent=None)])
            else:
                index.clear_pod(pod)

    return run


def test_readers_never_see_a_half_applied_batch() -> None:
    index = KVIndex(num_shards=16, max_keys=1_000_000, max_pods_per_key=64)
    pods = [PodRef(f"w{i}", dp_rank=i % 2) for i in range(NUM_WRITERS)]
    torn: list[str] = []

    def reader(seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(100 + seed)
            for _ in range(READER_LOOKUPS):
                prompt = SHARED_PREFIX[: rng.randrange(1, len(SHARED_PREFIX) + 1)]
                for holders in index.lookup(prompt):
                    held = set(holders)
                    for pod in pods:
                        if ((pod, TIER_GPU) in held) != ((pod, TIER_CPU) in held):
                            torn.append(f"{pod} on one tier only: {sorted(held)}")
                for score in score_prefix(index, prompt, block_size=16):
                    gpu, cpu = score.by_tier.get(TIER_GPU, 0), score.by_tier.get(TIER_CPU, 0)
                    if not gpu == cpu == score.matched_blocks:
                        torn.append(f"score with unequal tier runs: {score}")

        return run

    errors = run_threads(
        [writer(index, pod, seed) for seed, pod in enumerate(pods)] + [reader(i) for i in range(NUM_READERS)]
    )
    assert errors == []
    assert torn == []
    assert index.check_consistency() == []


def test_tiny_capacities_under_contention_stay_consistent() -> None:
    index = KVIndex(num_shards=4, max_keys=64, max_pods_per_key=2)
    pods = [PodRef(f"w{i}") for i in range(NUM_WRITERS)]

    def reader() -> None:
        for _ in range(READER_LOOKUPS):
            index.lookup(SHARED_PREFIX)
            score_prefix(index, SHARED_PREFIX, block_size=16, pods=["w0", "w1"])
            index.num_entries()
            index.pods()

    errors = run_threads([writer(index, pod, seed) for seed, pod in enumerate(pods)] + [reader] * NUM_READERS)
    assert errors == []
    assert index.check_consistency() == []
    assert index.num_keys() <= 64


def test_long_stores_stay_atomic_to_readers_of_every_kind() -> None:
    """Events long enough that the compiled core stores them without the GIL, on keys that keep growing
    its table: every reader (lookups, scores, counts) must see each event whole or not at all."""
    index = KVIndex(num_shards=1, max_keys=1_000_000, max_pods_per_key=64)
    pods = [PodRef("long-a"), PodRef("long-b")]
    chain_length = 8192  # above shard_table.h's RELEASE_GIL_KEYS (4096)
    chains = {pod: [] for pod in pods}  # type: dict[PodRef, list[list[int]]]
    done = threading.Event()
    torn: list[str] = []

    def long_writer(pod: PodRef, seed: int) -> Callable[[], None]:
        def run() -> None:
            for n in range(60):
                chain = [(seed << 40) + n * chain_length + i for i in range(chain_length)]
                index.apply(pod, [BlocksStored(tuple(chain), None, (), 16)])
                chains[pod].append(chain)
                if n % 20 == 19:
                    index.apply(pod, [AllBlocksCleared()])
            done.set()

        return run

    def lookup_reader() -> None:
        while not done.is_set():
            for pod in pods:
                if chains[pod]:
                    chain = chains[pod][-1]
                    found = len(index.lookup(chain))
                    if found not in (0, chain_length):
                        torn.append(f"{pod}: {found} of a {chain_length}-block event")
                    scores = score_prefix(index, chain, block_size=16)
                    if scores and scores[0].matched_blocks != chain_length:
                        torn.append(f"{pod}: a score of {scores[0].matched_blocks} blocks")

    def count_reader(count: Callable[[], int]) -> Callable[[], None]:
        # One count in a loop, so that one (unless it waits on the index's lock) lands while a store
        # runs without the GIL.
        def run() -> None:
            while not done.is_set():
                if count() % chain_length:
                    torn.append(f"{count}: {count()}, not whole events")

        return run

    counts: list[Callable[[], int]] = [
        index.num_keys,
        index.num_entries,
        lambda: index.pod_block_count(pods[0]),
        lambda: sum(index.pod_block_count(pod) for pod in index.pods()),
    ]

    errors = run_threads(
        [long_writer(pod, seed) for seed, pod in enumerate(pods)]
        + [lookup_reader]
        + [count_reader(count) for count in counts]
    )
    assert errors == []
    assert torn == []
    assert index.check_consistency() == []
