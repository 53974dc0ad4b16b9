"""The sidecar, assembled: the ingest pipeline dialling the engine (one stream per DP rank, the same
gap / replay / restart / join logic as `kvindex serve`, every eligible BlockStored hash-checked) with the
relay as its observer, and one downstream vLLM-compatible publisher per rank. The HTTP side
(sidecar/http.py) reads it."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import PodConfig
from kvindex.indexer.snapshot import PodSnapshot
from kvindex.indexer.status import PodStatus
from kvindex.replay.publisher import EventPublisher
from kvindex.sidecar.relay import RankCounts, Relay
from kvindex.sidecar.settings import SidecarSettings

log = logging.getLogger("kvindex.sidecar")


class RankStatus(msgspec.Struct, frozen=True):
    """One DP rank as `/v1/status` shows it."""

    dp_rank: int
    engine: PodStatus
    engine_endpoint: str
    engine_replay_endpoint: str | None
    publish_endpoint: str
    replay_endpoint: str | None
    downstream_seq: int | None
    blocks: int
    partial: bool
    hash_checks_total: int
    hash_mismatches_total: int
    # BlockStored with token ids that could not be recomputed (a parent never checked, extra keys).
    hash_unverifiable_total: int
    hash_check: str  # "ok", "mismatch", or "unchecked" (no checkable BlockStored seen yet)
    relay: RankCounts


class SidecarStatus(msgspec.Struct, frozen=True):
    sidecar_id: str
    pod: str
    model: str
    block_size: int
    hash_algo: str
    uptime_s: float
    ranks: list[RankStatus]


class SidecarService:
    """Owns the engine-side ingest service, the relay and the downstream publishers. `start`/`stop`."""

    def __init__(
        self, settings: SidecarSettings, *, release_heap: Callable[[], object] | None = None
    ) -> None:
        if len(settings.engine_replays) not in (0, len(settings.engines)):
            raise ValueError("give one --engine-replay per --engine (or none)")
        if "@" in settings.pod_id:
            raise ValueError(f"pod id {settings.pod_id!r} must not contain '@'")
        self.settings = settings
        self.sidecar_id = uuid.uuid4().hex
        self.started_at = time.monotonic()
        model = settings.model
        replays = settings.engine_replays or (None,) * len(settings.engines)
        self._pods = [
            PodConfig(settings.pod_id, endpoint, model.name, replay, dp_rank=rank)
            for rank, (endpoint, replay) in enumerate(zip(settings.engines, replays, strict=True))
        ]
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.publishers: dict[int, EventPublisher] = {}
        try:
            for rank in range(len(settings.engines)):
                self.publishers[rank] = EventPublisher(
                    settings.publish,
                    replay_endpoint=settings.replay,
                    topic=settings.topic,
                    buffer_steps=settings.buffer_steps,
                    dp_rank=rank,
                    bind=settings.publish_bind,
                    hwm=settings.hwm,
                    ctx=self._ctx,
                    # The block set already holds a batch the queue refuses: wait rather than drop.
                    publish_timeout_s=30.0,
                )
        except BaseException:
            self._close_publishers()
            raise
        self.relay = Relay(
            settings.pod_id, model, self.publishers, sidecar_id=self.sidecar_id, partial_of=self._partial_of
        )
        ingest_settings = IngestSettings(
            # The relay checks every BlockStored (sidecar/hash_check.py); ingest's own sampled check of
            # root runs would only repeat it.
            hash_check_every=1 << 30,
            quiet_probe_after_s=settings.quiet_probe_after_s,
            replay_timeout_s=settings.replay_timeout_s,
            # The engine's block set is the product: never dropped for a long outage.
            forget_after_s=float("inf"),
            disconnected_grace_s=float("inf"),
            reconnect_ivl_max_ms=settings.reconnect_ivl_max_ms,
        )
        self.ingest = IngestService(
            [model], self._pods, settings=ingest_settings, release_heap=release_heap, observer=self.relay
        )

    def start(self) -> None:
        self.ingest.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self.ingest.stop(timeout_s)
        self._close_publishers()
        self._ctx.destroy(linger=0)

    def _close_publishers(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()

    # -- reads -----------------------------------------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        return self.relay.snapshot()

    def _stream(self, rank: int) -> PodStatus | None:
        return next((s for s in self.ingest.pod_statuses() if s.dp_rank == rank), None)

    def _partial_of(self, rank: int) -> bool:
        return self.ingest.view_flagged(PodRef(self.settings.pod_id, rank))

    def _hash_counts_of(self, rank: int) -> tuple[int, int]:
        check = self.relay.hash_checks[rank]
        return check.checked, check.mismatched

    def ready(self) -> tuple[bool, str | None]:
        """Ready once every rank's engine stream has joined (its state is no longer `replaying`)."""
        for status in self.ingest.pod_statuses():
            if status.state in ("replaying", "disconnected"):
                return False, f"engine rank {status.dp_rank}: {status.state}"
        return True, None

    def status(self) -> SidecarStatus:
        ranks = []
        by_rank = {s.dp_rank: s for s in self.ingest.pod_statuses()}
        for rank, publisher in sorted(self.publishers.items()):
            engine = by_rank[rank]
            checks, mismatches = self._hash_counts_of(rank)
            pod = self._pods[rank]
            ranks.append(
                RankStatus(
                    dp_rank=rank,
                    engine=engine,
                    engine_endpoint=pod.endpoint,
                    engine_replay_endpoint=pod.replay_endpoint,
                    publish_endpoint=publisher.endpoint,
                    replay_endpoint=publisher.replay_endpoint,
                    downstream_seq=self.relay.downstream_seq(rank),
                    blocks=self.relay.num_blocks(rank),
                    partial=engine.partial_view or engine.state == "resyncing",
                    hash_checks_total=checks,
                    hash_mismatches_total=mismatches,
                    hash_unverifiable_total=self.relay.hash_checks[rank].unverifiable,
                    hash_check="mismatch" if mismatches else "ok" if checks else "unchecked",
                    relay=msgspec.structs.replace(self.relay.counts[rank]),
                )
            )
        model = self.settings.model
        return SidecarStatus(
            sidecar_id=self.sidecar_id,
            pod=self.settings.pod_id,
            model=model.name,
            block_size=model.block_size,
            hash_algo=model.hash_algo,
            uptime_s=time.monotonic() - self.started_at,
            ranks=ranks,
        )
