"""The write path, assembled: subscribers -> frames -> per-pod ordered queues -> sequence check
(gap -> replay, restart -> clear) -> decode -> domain events -> index apply.

`IngestService` is the one object the HTTP API and the CLI hold: it owns the per-model indexes and
hashers, the subscriber thread(s) and the per-pod workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvindex.hashing import BlockHasher
from kvindex.indexer.index import KVIndex
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import IngestCounters, PodStatus


class IngestSettings(msgspec.Struct, frozen=True):
    num_workers: int = 4  # per-pod ordered workers; a pod always maps to one (FNV-1a of pod id)
    queue_size: int = 10_000  # messages per worker queue; overflow becomes a gap repaired by replay
    silent_after_s: float = 60.0  # connected but nothing received for this long -> state `silent`
    quiet_probe_after_s: float = 5.0  # probe the replay socket when a pod went quiet after activity
    replay_timeout_s: float = 2.0
    hash_check_every: int = 64  # recompute hashes of 1 in N eligible BlockStored events
    index_shards: int = 16
    index_max_keys: int = 50_000_000
    index_max_pods_per_key: int = 256
    # Bind mode: replay endpoint of a pod that dialled in, from its topic `kv@<pod>@<model>`;
    # placeholders {pod}, {model}; vLLM's DP port offset is applied for ranks > 0. None: no replay.
    listen_replay_template: str | None = None


class ModelRuntime:
    """One model's index and hasher (the model's block size and hash settings hash its requests)."""

    config: ModelConfig
    hasher: BlockHasher
    index: KVIndex


class IngestService:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        pods: Sequence[PodConfig] = (),
        *,
        listen: str | None = None,
        settings: IngestSettings = IngestSettings(),
    ) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close subscriptions and stop workers; idempotent."""
        raise NotImplementedError

    def model(self, name: str) -> ModelRuntime | None:
        raise NotImplementedError

    def model_names(self) -> list[str]:
        raise NotImplementedError

    def pod_statuses(self) -> list[PodStatus]:
        raise NotImplementedError

    def counters(self) -> IngestCounters:
        """A snapshot of the process-wide counters."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Subscriptions up and no pod in its initial sync."""
        raise NotImplementedError
