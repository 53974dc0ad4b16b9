"""The Redis store on a real 3-node Redis Cluster: connect() picks the cluster client (explicit scheme or
detected), models whose hash tags live on different nodes share one client and each keep their keys on
their own node, a cluster named before it is up answers once it is (StoreUnavailable until then), and a
cluster URL naming a DB other than 0 is refused in one sentence.

Expected contents come from the events written, and key placement from the servers themselves (CLUSTER
KEYSLOT, and each node's own keyspace), never from the store's answers."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
import redis
from kvindex.indexer.events import TIER_GPU, BlocksStored, PodRef
from kvindex.indexer.store import LeaseClaim, StoreUnavailable
from kvindex.indexer.stores.redis_store import LazyCluster, RedisStore, connect, prefix_of
from redis.cluster import RedisCluster

pytestmark = pytest.mark.timeout(60)

POD = PodRef("pod-a")


def stored(keys: list[int]) -> BlocksStored:
    return BlocksStored(block_keys=tuple(keys), parent_key=None, token_ids=(), block_size=16, tier=TIER_GPU)


def models_on_two_nodes(cluster: Any) -> tuple[tuple[str, int], tuple[str, int]]:
    """Two model names whose key prefixes hash to slots owned by different nodes, with those nodes'
    ports (as the cluster reports the slots)."""
    seen: dict[int, str] = {}
    for number in itertools.count():
        name = f"model-{number}"
        port = cluster.slot_owner(cluster.key_slot(prefix_of(name) + "gen"))
        seen.setdefault(port, name)
        if len(seen) == 2:
            (port_a, name_a), (port_b, name_b) = seen.items()
            return (name_a, port_a), (name_b, port_b)
    raise AssertionError("unreachable")


def node_keys(port: int) -> set[str]:
    """Every key one node holds itself (a plain client: no redirection)."""
    node = redis.Redis(host="127.0.0.1", port=port)
    try:
        return {key.decode() for key in node.scan_iter(count=1000)}
    finally:
        node.close()


@pytest.mark.parametrize("form", ["redis+cluster", "redis"])
def test_both_url_forms_give_a_cluster_client(
    redis_cluster_url: str, redis_cluster: Any, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = redis_cluster_url if form == "redis+cluster" else redis_cluster.plain_url
    with caplog.at_level(logging.INFO, logger="kvindex.indexer.stores"):
        client = connect(url)
    try:
        assert isinstance(client, LazyCluster) and isinstance(client.cluster(), RedisCluster)
        detected = [r for r in caplog.records if "cluster mode on" in r.getMessage()]
        assert len(detected) == (1 if form == "redis" else 0)
        store = RedisStore(client, "m", num_shards=16)
        store.apply(POD, [stored([1, 2, 3])])
        assert store.lookup([1, 2, 3, 4]) == [((POD, TIER_GPU),)] * 3
        assert store.client_address().startswith("redis cluster 127.0.0.1:")
    finally:
        client.close()


def test_two_models_on_different_nodes_share_one_client(redis_cluster_url: str, redis_cluster: Any) -> None:
    (name_a, port_a), (name_b, port_b) = models_on_two_nodes(redis_cluster)
    assert port_a != port_b
    client = connect(redis_cluster_url)
    try:
        store_a, store_b = (RedisStore(client, name, num_shards=16) for name in (name_a, name_b))
        for store in (store_a, store_b):
            store.require_fences()
            _, (view,) = store.lease_tick("r1", 10_000, [LeaseClaim(POD, None, True)])
            store.set_fence(POD, view.token)
        store_a.apply(POD, [stored([1, 2, 3])])
        store_b.apply(POD, [stored([1, 2]), stored([7])])
        assert store_a.lookup([1, 2, 3]) == [((POD, TIER_GPU),)] * 3
        assert store_b.lookup([1, 2, 3]) == [((POD, TIER_GPU),)] * 2
        assert (store_a.num_keys(), store_b.num_keys()) == (3, 3)
        assert store_a.check_consistency() == [] and store_b.check_consistency() == []
    finally:
        client.close()
    on_a, on_b = node_keys(port_a), node_keys(port_b)
    assert on_a and all(key.startswith(prefix_of(name_a)) for key in on_a)
    assert on_b and all(key.startswith(prefix_of(name_b)) for key in on_b)


def test_a_cluster_named_before_it_is_up_answers_once_it_is(redis_cluster: Any) -> None:
    # redis_cluster is unused but for its rule: skip without redis-server, fail under CI=true.
    from benchmarks.redis_server import RedisClusterServers

    late = RedisClusterServers()  # ports chosen, nothing listening yet
    client = connect(late.url)
    try:
        store = RedisStore(client, "m", num_shards=16)
        with pytest.raises(StoreUnavailable, match="^redis cluster 127.0.0.1:"):
            store.apply(POD, [stored([1])])
        late.start()
        store.apply(POD, [stored([1, 2])])
        assert store.lookup([1, 2]) == [((POD, TIER_GPU),)] * 2
    finally:
        client.close()
        late.close()


@pytest.mark.parametrize("form", ["redis+cluster", "rediss+cluster", "redis"])
def test_a_cluster_url_naming_db_1_is_refused_in_one_sentence(redis_cluster: Any, form: str) -> None:
    port = redis_cluster.ports[0]
    url = f"{form}://127.0.0.1:{port}/1"
    with pytest.raises(ValueError) as caught:
        connect(url)
    message = str(caught.value)
    assert message == f"{url} is a Redis Cluster, which has only DB 0: drop /1 from the URL"
