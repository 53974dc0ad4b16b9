"""The Redis store's leases and fencing, two "replicas" (two RedisStore clients) on one real redis-server:
a write under a lease that lapsed and was taken by another replica is refused whole (LeaseLost) and
leaves the new owner's writes as they are; a store restarted empty is noticed (StoreReset).

Expected contents come from the events each side sent, never from the store's own answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kvindex.indexer.events import TIER_GPU, BlocksStored, PodRef
from kvindex.indexer.store import LeaseClaim, LeaseLost, StoreReset
from kvindex.indexer.stores.redis_store import RedisStore
from waiting import wait_for

pytestmark = pytest.mark.timeout(60)

POD = PodRef("pod-a")


def stored(keys: list[int]) -> BlocksStored:
    return BlocksStored(block_keys=tuple(keys), parent_key=None, token_ids=(), block_size=16)


@pytest.fixture
def clients(redis_url: str) -> Iterator[list[redis.Redis]]:
    made = [redis.Redis.from_url(redis_url, socket_timeout=10) for _ in range(2)]
    yield made
    for client in made:
        client.close()


def take(store: RedisStore, replica: str, ttl_ms: int) -> str | None:
    """One lease tick asking for POD; the token if this replica holds it after."""
    _, (view,) = store.lease_tick(replica, ttl_ms, [LeaseClaim(POD, None, True)])
    return view.token if view.token.startswith(replica + " ") else None


def test_a_lapsed_lease_refuses_the_old_owners_whole_batch(clients: list[redis.Redis]) -> None:
    old, new = (RedisStore(client, "m") for client in clients)
    for store in (old, new):
        store.require_fences()
    token = take(old, "r1", ttl_ms=300)
    assert token is not None and take(new, "r2", ttl_ms=300) is None  # held: not taken
    old.set_fence(POD, token)
    old.apply(POD, [stored([1, 2])])

    # r1 stalls past its TTL; r2 takes the pod over, clears it and rebuilds it.
    wait_for(
        lambda: take(new, "r2", ttl_ms=10_000) is not None, timeout_s=5, what="r2 taking the lapsed lease"
    )
    _, (view,) = new.lease_tick("r2", 10_000, [LeaseClaim(POD, None, False)])
    new.set_fence(POD, view.token)
    assert view.token != token  # a new epoch
    new.clear_pod(POD)
    new.apply(POD, [stored([10, 11])])

    # r1 resumes mid-batch: refused whole, nothing of it written.
    with pytest.raises(LeaseLost):
        old.apply(POD, [stored([3, 4]), stored([5])])
    with pytest.raises(LeaseLost):
        old.clear_pod(POD)
    assert new.snapshot() == {10: frozenset({(POD, TIER_GPU)}), 11: frozenset({(POD, TIER_GPU)})}
    assert new.check_consistency() == []


def test_a_pod_without_a_fence_is_not_written(clients: list[redis.Redis]) -> None:
    store = RedisStore(clients[0], "m")
    store.require_fences()
    with pytest.raises(LeaseLost):
        store.apply(POD, [stored([1])])
    assert store.num_keys() == 0


def test_a_store_restarted_empty_is_a_reset(clients: list[redis.Redis], redis_server: Any) -> None:
    store = RedisStore(clients[0], "m")
    store.apply(POD, [stored([1, 2])])
    redis_server.stop()
    redis_server.start()  # empty: no persistence
    with pytest.raises(StoreReset):
        store.apply(POD, [stored([3])])
    store.apply(POD, [stored([3])])  # the new generation is adopted
    assert store.snapshot() == {3: frozenset({(POD, TIER_GPU)})}
