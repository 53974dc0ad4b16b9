"""Shared parts of the ingest pipeline tests (no tests here): does the index hold what each engine holds
(engines.Engine's reference), the service's row for an engine, and a replay ROUTER that keeps a worker
busy on demand."""

from __future__ import annotations

from engines import Engine
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.status import PodStatus


def indexed_keys(index: KVIndex, pod: PodRef, universe: set[int]) -> set[int]:
    """The keys among `universe` that the index says `pod` holds (any tier)."""
    held = set()
    for key in universe:
        holders = index.lookup([key])
        if holders and any(entry_pod == pod for entry_pod, _ in holders[0]):
            held.add(key)
    return held


def index_matches(index: KVIndex, engines: list[Engine]) -> bool:
    universe = set().union(*(engine.ever for engine in engines))
    return all(indexed_keys(index, engine.ref, universe) == set(engine.held) for engine in engines)


def status_of(service: IngestService, engine: Engine) -> PodStatus:
    """The service's status row for this engine's (pod, dp rank)."""
    return next(
        s for s in service.pod_statuses() if (s.pod, s.dp_rank) == (engine.ref.pod_id, engine.ref.dp_rank)
    )
