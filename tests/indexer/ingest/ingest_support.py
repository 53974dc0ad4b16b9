"""Shared parts of the ingest pipeline tests (no tests here): does the index hold what each engine holds
(engines.Engine's reference), the service's row for an engine, and a replay ROUTER that keeps a worker
busy on demand."""

from __future__ import annotations

import zmq
from engines import Engine
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.status import PodStatus
from kvindex.replay.frames import replay_end_frames


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


class SilentReplay:
    """A replay ROUTER that holds requests until released: keeps a worker busy deterministically."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity: bytes | None = None

    def wait_request(self, timeout_s: float = 10.0) -> None:
        assert self.router.poll(int(timeout_s * 1000)), "no replay request arrived"
        self.identity = self.router.recv_multipart()[0]

    def release(self) -> None:
        assert self.identity is not None
        self.router.send_multipart(replay_end_frames(self.identity))

    def close(self) -> None:
        self.ctx.destroy(linger=0)
