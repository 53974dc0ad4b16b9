"""The Redis store clears a big pod in bounded calls: a pod's clear (clear_pod, or an AllBlocksCleared
anywhere in a batch) runs as script calls of at most `clear_chunk_keys` keys each, so other clients never
wait behind one long script; the result and the counts are the in-memory KVIndex's for the same events.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.stores.redis_store import RedisStore

pytestmark = pytest.mark.timeout(60)

BIG = PodRef("big")
OTHER = PodRef("other")
CHUNK = 64


def stored(keys: list[int], tier: str = "GPU") -> BlocksStored:
    return BlocksStored(block_keys=tuple(keys), parent_key=None, token_ids=(), block_size=16, tier=tier)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield made
    made.close()


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def both(client: redis.Redis) -> tuple[RedisStore, KVIndex]:
    return RedisStore(client, "m", num_shards=16, clear_chunk_keys=CHUNK), KVIndex(num_shards=16)


def fill(stores: tuple[RedisStore, KVIndex], rng: random.Random) -> list[int]:
    """BIG holds ~1,000 keys on two tiers (some shared with OTHER, some stored twice, some removed)."""
    keys = [rng.getrandbits(64) for _ in range(1000)]
    batches: list[tuple[PodRef, list[KVEvent]]] = [
        (OTHER, [stored(keys[:100])]),
        (BIG, [stored(keys[:600]), stored(keys[500:800], tier="CPU"), stored(keys[:50])]),
        (BIG, [BlocksRemoved(block_keys=tuple(keys[100:150]), tier="GPU"), stored(keys[800:])]),
    ]
    for pod, events in batches:
        for store in stores:
            store.apply(pod, events)
    return keys


def test_clear_pod_of_many_keys_runs_in_bounded_calls_and_matches_the_memory_store(
    client: redis.Redis,
) -> None:
    stores = both(client)
    redis_store, memory = stores
    keys = fill(stores, random.Random(1))
    before = evalsha_calls(client)
    cleared = redis_store.clear_pod(BIG)
    calls = evalsha_calls(client) - before
    assert cleared == memory.clear_pod(BIG)
    assert calls >= 1000 // CHUNK  # the work was split...
    assert calls <= 2 + (1000 + 300 + 50) // CHUNK + 1  # ...into calls of at most CHUNK log keys
    assert redis_store.snapshot_copies() == memory.snapshot_copies()
    assert redis_store.pod_block_count(BIG) == 0 and redis_store.pod_block_count(OTHER) == 100
    assert redis_store.num_keys() == memory.num_keys() == 100
    assert redis_store.check_consistency() == []
    # The cleared pod stores again as a fresh one.
    for store in stores:
        store.apply(BIG, [stored(keys[:10])])
    assert redis_store.snapshot_copies() == memory.snapshot_copies()


@pytest.mark.parametrize("where", ["first", "middle", "last", "twice"])
def test_a_batch_with_a_clear_anywhere_ends_and_counts_as_the_memory_store(
    client: redis.Redis, where: str
) -> None:
    stores = both(client)
    redis_store, memory = stores
    keys = fill(stores, random.Random(2))
    clear: list[KVEvent] = [AllBlocksCleared()]
    before = [stored(keys[:300])]
    after = [stored(keys[200:400], tier="CPU"), BlocksRemoved(block_keys=tuple(keys[200:210]), tier="CPU")]
    events = {
        "first": clear + before + after,
        "middle": before + clear + after,
        "last": before + after + clear,
        "twice": before + clear + after + clear + before,
    }[where]
    assert redis_store.apply(BIG, events) == memory.apply(BIG, events)
    assert redis_store.snapshot_copies() == memory.snapshot_copies()
    assert redis_store.check_consistency() == []
