"""Each configured model's runtime: its settings, the hasher that checks its events, and its index.

The one thing the write path (indexer/ingest/) and the read path (api/) both hold; built once at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvindex.hashing import BlockHasher
from kvindex.indexer.index import KVIndex
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.store import Store


class ModelRuntime:
    """One model's index and hasher (the model's block size and hash settings hash its requests)."""

    def __init__(self, config: ModelConfig, index: Store) -> None:
        self.config = config
        self.hasher = BlockHasher(algo=config.hash_algo, block_size=config.block_size, seed=config.hash_seed)
        self.index = index


class ModelRegistry:
    """Model name -> ModelRuntime, fixed at construction; every index built with the same bounds.

    `store_factory` builds each model's store instead of an in-memory KVIndex (the index bounds are then
    the factory's)."""

    def __init__(
        self,
        models: Sequence[ModelConfig],
        *,
        index_shards: int = 1,
        index_max_keys: int = 50_000_000,
        index_max_pods_per_key: int = 256,
        store_factory: Callable[[ModelConfig], Store] | None = None,
    ) -> None:
        if not models:
            raise ValueError("at least one model is needed")
        self._by_name: dict[str, ModelRuntime] = {}
        for config in models:
            if config.name in self._by_name:
                raise ValueError(f"model {config.name!r} is configured twice")
            index: Store
            if store_factory is not None:
                index = store_factory(config)  # a shared store (Redis): built by the process shell
            else:
                index = KVIndex(
                    num_shards=index_shards, max_keys=index_max_keys, max_pods_per_key=index_max_pods_per_key
                )
            self._by_name[config.name] = ModelRuntime(config, index)

    def get(self, name: str) -> ModelRuntime | None:
        return self._by_name.get(name)

    def __getitem__(self, name: str) -> ModelRuntime:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[ModelRuntime]:
        return iter(self._by_name.values())

    def names(self) -> list[str]:
        return sorted(self._by_name)
