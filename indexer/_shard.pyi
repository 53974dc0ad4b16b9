from collections.abc import Callable

from kvindex.indexer.shard import ShardCore

# The compiled shard type (indexer/_shard.c): (capacity, max_pods_per_key) -> a shard implementing
# shard.py's ShardCore protocol, nothing more; it is only ever used through that protocol.
Shard: Callable[[int, int], ShardCore]
