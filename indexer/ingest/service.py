"""The write path, assembled: subscriber poller -> intake -> per-pod ordered queues -> stream worker ->
each model's index; plus the pipeline's lifecycle, its status and a watch thread (quiet probes, idle heap
release).

`IngestService` is what the CLI and the demo build and the HTTP API reads (through `IngestView`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import cast

import zmq
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest.counters import Counters
from kvindex.indexer.ingest.heap import HeapRelease
from kvindex.indexer.ingest.intake import Intake
from kvindex.indexer.ingest.leases import LeaseManager
from kvindex.indexer.ingest.observer import BatchObserver
from kvindex.indexer.ingest.pod_queues import PodQueues
from kvindex.indexer.ingest.settings import DEFAULT_SETTINGS, IngestSettings
from kvindex.indexer.ingest.snapshot_fetcher import SnapshotFetcher, SnapshotResult
from kvindex.indexer.ingest.streams import (
    ControlItem,
    ReplayDone,
    SnapshotDone,
    Stream,
    StreamTable,
    WorkItem,
)
from kvindex.indexer.ingest.worker import StreamWorker
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.registry import ModelRegistry, ModelRuntime
from kvindex.indexer.status import (
    STATE_DISCONNECTED,
    STATE_HASH_MISMATCH,
    STATE_LIVE,
    STATE_REPLAYING,
    STATE_RESYNCING,
    STATE_SILENT,
    HealthReader,
    IngestCounters,
    PodHealth,
    PodStatus,
    Readiness,
)
from kvindex.indexer.store import Store
from kvindex.replay.replay_client import ReplayResult
from kvindex.replay.replay_fetcher import ReplayFetcher
from kvindex.replay.subscriber import Subscriber

log = logging.getLogger("kvindex.indexer.ingest")

_LISTEN_SOURCE = "listen"


_WATCH_INTERVAL_S = 0.1
# Streams the watch looks at between two releases of the GIL (~0.1 ms of its work).
_WATCH_CHUNK = 64


def age_ms(now: float, at: float) -> float:
    """Seconds from `at` to `now` to the millisecond: finer is noise to a router, and each score entry's
    age was 17 significant digits of JSON (a tenth of the entry) for its client to parse. Not round(): it
    formats the float to round it (~290 ns against ~70 here). Never negative, though a worker may stamp
    `at` just after `now` was read."""
    return max(0, int((now - at) * 1000.0 + 0.5)) / 1000.0


def _likely_cause(stream: Stream, state: str, now: float, settings: IngestSettings) -> str:
    if state == STATE_DISCONNECTED:
        where = stream.endpoint or "the bound listen endpoint"
        return f"nothing connected at {where}: engine down or restarting, or a wrong endpoint"
    if state == STATE_SILENT:
        heard = stream.last_event_at if stream.last_event_at is not None else stream.created_at
        return (
            f"connected, but no events for {now - heard:.0f} s: an idle engine, or KV events / prefix caching "
            "off in the engine"
        )
    if state == STATE_RESYNCING:
        return "batches lost beyond the replay ring; kept what the ring had until the engine's next clear"
    if state == STATE_HASH_MISMATCH:
        return "its block hashes or block size differ from the model's settings (see the earlier warning)"
    if state == STATE_REPLAYING:
        return "replaying the engine's ring"
    return ""


# The longest wait between two checks of a stream whose replay socket does not answer.
_MAX_CHECK_INTERVAL_S = 60.0


class IngestService:
    """Subscribes to every pod, keeps each model's index in step with its pods' event streams.

    Connect mode: one SUB per `PodConfig` (a (pod, dp rank) stream). Bind mode (`listen`, one endpoint or
    several): one bound SUB per endpoint that engines dial — several because vLLM offsets the PUB
    endpoint by the DP rank too (rank r of `tcp://kvindex:5557` dials 5557+r); every bound SUB accepts
    any pod and rank, streams appear on their first message. Either way each stream first replays its
    engine's ring from seq 0 (state `replaying`; `ready()` is False meanwhile). With neither pods nor
    listen the service is an empty shell around the indexes (tools fill them directly): it starts and
    is ready at once.

    `release_heap`: called to hand freed heap pages back to the OS after ingest bursts (the process shell
    supplies glibc's malloc_trim where it exists); None leaves that to the allocator.

    `observer`: told of every applied batch (with its payload bytes) and every clear, in stream order, on
    the pod's worker thread (the sidecar relays its engine's stream through it; see observer.py).

    `store_factory`: each model's store instead of an in-memory index. A store that keeps leases (Redis)
    makes this process one replica of several: it ingests only the pods whose lease it holds
    (indexer/ingest/leases.py) and reads the others' states from the store.
    """

    def __init__(
        self,
        models: Sequence[ModelConfig],
        pods: Sequence[PodConfig] = (),
        *,
        listen: str | Sequence[str] | None = None,
        settings: IngestSettings = DEFAULT_SETTINGS,
        release_heap: Callable[[], object] | None = None,
        observer: BatchObserver | None = None,
        store_factory: Callable[[ModelConfig], Store] | None = None,
    ) -> None:
        self.settings = settings
        self.listen: tuple[str, ...] = (listen,) if isinstance(listen, str) else tuple(listen or ())
        self.models = ModelRegistry(
            models,
            index_shards=settings.index_shards,
            index_max_keys=settings.index_max_keys,
            index_max_pods_per_key=settings.index_max_pods_per_key,
            store_factory=store_factory,
        )
        leased = store_factory is not None and all(hasattr(m.index, "lease_tick") for m in self.models)
        self._streams = StreamTable(leased=leased)
        for pod in pods:
            if pod.model not in self.models:
                raise ValueError(f"pod {pod.pod_id!r} names model {pod.model!r}, which is not configured")
            if "@" in pod.pod_id:
                raise ValueError(f"pod id {pod.pod_id!r} must not contain '@'")
            ref = PodRef(pod.pod_id, pod.dp_rank)
            stream = Stream(
                ref,
                pod.model,
                pod.endpoint,
                pod.replay_endpoint,
                connect_mode=True,
                snapshot_url=pod.snapshot_url,
            )
            self._streams.add_connect(f"pod:{pod.pod_id}:{pod.dp_rank}", stream)
        self._counters = Counters()
        # Bind-mode source id -> the resolved address engines dial (what their status shows).
        self._listen_sources: dict[str, str] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq allows 1,023 sockets per context by default; each connect-mode pod costs a SUB and a
        # monitor pair, and replays open DEALERs, so a 1,000-pod fleet needs more (set before any socket).
        self._ctx.set(zmq.MAX_SOCKETS, max(1024, 4 * len(pods) + 4 * len(self.listen) + 256))
        self._heap = HeapRelease(release_heap)
        self._queues: PodQueues[WorkItem] = PodQueues(
            self._handle_many,
            num_workers=settings.num_workers,
            queue_size=settings.queue_size,
            max_batch=settings.max_batch,
        )
        self._fetcher = ReplayFetcher(
            self._on_replay_result,
            ctx=self._ctx,
            timeout_s=settings.replay_timeout_s,
            max_in_flight=settings.max_concurrent_replays,
        )
        self._snapshot_fetcher = SnapshotFetcher(
            self._on_snapshot_result,
            timeout_s=settings.snapshot_timeout_s,
            max_bytes=settings.snapshot_max_bytes,
        )
        self._worker = StreamWorker(
            settings,
            self._streams,
            self.models,
            self._counters,
            self._ctx,
            self._listen_sources,
            self._heap,
            self._queues.depth,
            self._fetcher,
            self._snapshot_fetcher,
            observer,
        )
        self._intake = Intake(settings, self._streams, self.models.names(), self._queues, self._counters)
        self._subscriber = Subscriber(
            self._intake.on_frames,
            self._intake.on_link,
            ctx=self._ctx,
            rcvhwm=settings.rcvhwm,
            reconnect_ivl_ms=settings.reconnect_ivl_ms,
            reconnect_ivl_max_ms=settings.reconnect_ivl_max_ms,
            max_message_bytes=settings.max_message_bytes,
        )
        self.leases: LeaseManager | None = None
        if leased:
            self.leases = LeaseManager(
                settings.replica_id or f"{socket.gethostname()}:{os.getpid()}",
                settings.lease_ttl_s,
                self._streams,
                self.models,
                lambda pod_id, item: self._intake.submit(pod_id, item, force=True),
                lambda stream: self._state_of(stream, time.monotonic()),
            )
        self._state = "new"
        self._stop_event = threading.Event()
        self._watch_thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the subscriptions and start the threads; idempotent. Address errors raise here."""
        if self._state != "new":
            return
        self._state = "running"
        for source_id, stream in self._streams.by_source.items():
            self._subscriber.add_connect(source_id, stream.endpoint)
        for idx, endpoint in enumerate(self.listen):
            source_id = f"{_LISTEN_SOURCE}:{idx}"
            self._listen_sources[source_id] = self._subscriber.add_bind(source_id, endpoint)
        self._fetcher.start()
        self._queues.start()
        for stream in self._streams.by_source.values():
            self._intake.submit(stream.ref.pod_id, ControlItem("join", stream.ref))
        self._subscriber.start()
        if self.leases is not None:
            self.leases.start()
        self._watch_thread = threading.Thread(target=self._watch, name="kvindex-ingest-watch", daemon=True)
        self._watch_thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Close subscriptions, abandon queued work and outstanding replays, and join every thread within
        `timeout_s` in all; idempotent."""
        if self._state == "stopped":
            return
        was_running = self._state == "running"
        self._state = "stopped"
        self._stop_event.set()
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self.leases is not None and was_running:
            self.leases.stop(left())
        subscriber_stopped = self._subscriber.stop(left())
        fetcher_stopped = self._fetcher.stop(left())
        self._snapshot_fetcher.stop()
        workers_stopped = self._queues.stop(left()) if was_running else True
        if self._watch_thread is not None:
            self._watch_thread.join(left())
        if subscriber_stopped and fetcher_stopped and workers_stopped:
            self._ctx.destroy(linger=0)
        else:
            log.warning("ingest threads did not stop within %.1f s; leaving the ZMQ context open", timeout_s)

    # -- queries (IngestView) -------------------------------------------------------------------

    @property
    def listen_endpoints(self) -> list[str]:
        """Every bound SUB's resolved address (ephemeral ports filled in), in `listen` order; [] before
        `start` or without bind mode."""
        return list(self._listen_sources.values())

    @property
    def listen_endpoint(self) -> str | None:
        """The first bound SUB's resolved address, or None."""
        return next(iter(self._listen_sources.values()), None)

    def model(self, name: str) -> ModelRuntime | None:
        return self.models.get(name)

    def model_names(self) -> list[str]:
        return self.models.names()

    def pod_statuses(self) -> list[PodStatus]:
        """Every stream's status; the block counts in one read of each model's store (with a shared store,
        one round trip per model; StoreUnavailable if it cannot be reached)."""
        now = time.monotonic()
        streams = sorted(self._streams.all(), key=lambda s: s.ref)
        counts = {runtime.config.name: runtime.index.pod_block_counts() for runtime in self.models}
        return [self._status(stream, now, counts.get(stream.model)) for stream in streams]

    def applied_seqs(self) -> dict[PodRef, int | None]:
        """Each stream's newest seq whose events are in the index (cheap: no index reads; for progress
        checks and benchmarks)."""
        return {stream.ref: stream.indexed_seq for stream in self._streams.all()}

    def counters(self) -> IngestCounters:
        """A snapshot of the process-wide counters."""
        return self._counters.snapshot()

    def ready(self) -> bool:
        """Subscriptions up and no reachable pod in its initial sync (see `readiness`, min 0 live pods)."""
        return self.readiness(0).ready

    def readiness(self, min_live_pods: int = 1) -> Readiness:
        """Ready: running, at least `min_live_pods` pods live, and no pod that can be reached still in its
        first sync. A pod that cannot be reached is `disconnected`, not syncing: one dead engine among a
        hundred holds nothing back. A service with no pods and no listen endpoint has nothing to wait for."""
        if self._state != "running":
            return Readiness(False, "ingest: not running")
        if self.leases is not None and self.leases.store_error is not None:
            return Readiness(False, self.leases.store_error)
        now = time.monotonic()
        states = [(stream, self._state_of(stream, now)) for stream in self._streams.all()]
        syncing = [s for s, state in states if state == STATE_REPLAYING]
        live = sum(1 for _, state in states if state == STATE_LIVE)
        if syncing:
            names = ", ".join(f"{s.ref.pod_id}/{s.ref.dp_rank}" for s in syncing[:5])
            more = f" and {len(syncing) - 5} more" if len(syncing) > 5 else ""
            return Readiness(
                False, f"ingest: {len(syncing)} pod(s) still in their first sync ({names}{more})", live
            )
        if not states and not self.listen:
            return Readiness(True, None, 0)
        if live < min_live_pods:
            return Readiness(
                False, f"ingest: {live} pod(s) live, at least {min_live_pods} needed (--min-live-pods)", live
            )
        return Readiness(True, None, live)

    def pod_health(self, pod_id: str, dp_rank: int) -> PodHealth | None:
        return self.pod_healths([PodRef(pod_id, dp_rank)])[0]

    def pod_healths(self, refs: Sequence[PodRef], now: float | None = None) -> list[PodHealth | None]:
        """The health of each stream, None for one no stream feeds; one clock reading for all (a score
        answer reads every scored pod's at once), `now` if given."""
        if now is None:
            now = time.monotonic()
        get = self._streams.get
        state_of = self._state_of
        # The common case inline (a score answer reads ~200 of these): an owned, connected, joined stream
        # with nothing flagged, heard from within silent_after_s, is live; any other takes _state_of.
        unowned_matter = self.leases is not None
        listen_up = self._intake.listen_peers > 0
        silent_after_s = self.settings.silent_after_s
        healths: list[PodHealth | None] = []
        append = healths.append
        for ref in refs:
            stream = get(ref)
            if stream is None:
                append(None)
                continue
            last_event_at = stream.last_event_at
            tracker = stream.tracker
            if (
                last_event_at is not None
                and now - last_event_at <= silent_after_s
                and (stream.connected if stream.connect_mode else listen_up)
                and stream.joined
                and not tracker.resyncing
                and not stream.hash_mismatch
                and (stream.owned or not unowned_matter)
            ):
                append(PodHealth(STATE_LIVE, age_ms(now, last_event_at), None))
                continue
            state = state_of(stream, now)
            append(
                PodHealth(
                    state,
                    None if last_event_at is None else age_ms(now, last_event_at),
                    now - stream.disconnected_at if state == STATE_DISCONNECTED else None,
                )
            )
        return healths

    def health_reader(self) -> HealthReader:
        """pod_healths' inputs for the compiled answer writer, which reads the common case itself."""
        now = time.monotonic()
        return HealthReader(
            self._streams.by_ref,
            now,
            self.settings.silent_after_s,
            self._intake.listen_peers > 0,
            self.leases is not None,
            functools.partial(self._health_at, now),
        )

    def _health_at(self, now: float, ref: PodRef) -> PodHealth | None:
        return self.pod_healths([ref], now)[0]

    def view_flagged(self, ref: PodRef) -> bool:
        """Whether the stream `ref`'s view may miss history (partial_view or resyncing); cheap."""
        stream = self._streams.get(ref)
        return stream is not None and (stream.tracker.partial_view or stream.tracker.resyncing)

    def hash_check_counts(self, ref: PodRef) -> tuple[int, int]:
        """(BlockStored events hash-checked, mismatches found) on the stream `ref`; (0, 0) if unknown."""
        stream = self._streams.get(ref)
        return (0, 0) if stream is None else (stream.hash_checks_total, stream.hash_mismatches_total)

    def _status(self, stream: Stream, now: float, counts: dict[PodRef, int] | None = None) -> PodStatus:
        tracker = stream.tracker
        blocks = (
            counts.get(stream.ref, 0)
            if counts is not None
            else self.models[stream.model].index.pod_block_count(stream.ref)
        )
        return PodStatus(
            pod=stream.ref.pod_id,
            model=stream.model,
            dp_rank=stream.ref.dp_rank,
            endpoint=stream.endpoint,
            state=self._state_of(stream, now),
            last_seq=stream.indexed_seq,
            last_event_age_s=None if stream.last_event_at is None else age_ms(now, stream.last_event_at),
            events_total=stream.events_total,
            gaps_total=tracker.num_gaps,
            replays_total=stream.replays_total,
            blocks=blocks,
            hash_mismatches_total=stream.hash_mismatches_total,
            partial_view=tracker.partial_view,
            restarts_total=tracker.num_restarts,
            owner=self.leases.owner_of(stream.ref) if self.leases is not None else None,
        )

    def _state_of(self, stream: Stream, now: float) -> str:
        if not stream.owned and self.leases is not None:
            # Another replica ingests it: the state it published (none yet, or no owner: replaying).
            return self.leases.published_state(stream.ref) or STATE_REPLAYING
        connected = stream.connected if stream.connect_mode else self._intake.listen_peers > 0
        if not connected:
            return STATE_DISCONNECTED
        if not stream.joined:
            return STATE_REPLAYING
        if stream.hash_mismatch:
            return STATE_HASH_MISMATCH
        if stream.tracker.resyncing:
            return STATE_RESYNCING
        last_heard = stream.last_event_at if stream.last_event_at is not None else stream.created_at
        if now - last_heard > self.settings.silent_after_s:
            return STATE_SILENT
        return STATE_LIVE

    # -- threads --------------------------------------------------------------------------------

    def _handle_many(self, entries: list[tuple[str, WorkItem]]) -> None:
        self._worker.handle_many(entries)

    def _on_replay_result(self, key: Hashable, result: ReplayResult) -> None:
        """On the fetcher's thread: the answer joins the pod's ordered queue (past its bound: the stream
        waits for it)."""
        ref, token = cast(tuple[PodRef, int], key)
        self._queues.submit(ref.pod_id, ReplayDone(ref, token, result), force=True)

    def _on_snapshot_result(self, key: Hashable, result: SnapshotResult) -> None:
        """On a snapshot pool thread: the answer joins the pod's ordered queue."""
        ref, token = cast(tuple[PodRef, int], key)
        self._queues.submit(ref.pod_id, SnapshotDone(ref, token, result), force=True)

    def _watch(self) -> None:
        """Probes and the idle heap release. A stream is probed once it has been quiet for
        `quiet_probe_after_s` after activity or after its connection (its last message may be lost, or
        it published before we were subscribed), and again with a doubling interval while a check could
        not be made (`needs_check`: its replay socket did not answer)."""
        quiet_s = self.settings.quiet_probe_after_s
        forget_s = self.settings.forget_after_s
        while not self._stop_event.wait(min(_WATCH_INTERVAL_S, quiet_s / 4)):
            self._heap.tick(idle=not self._queues.depth())
            now = time.monotonic()
            for number, stream in enumerate(self._streams.all()):
                if number and not number % _WATCH_CHUNK:
                    # Let a waiting thread in: one pass over 1,000 streams held the GIL for milliseconds,
                    # ten times a second, and a score request waiting on it stalled for the GIL's whole
                    # switch interval (the p99 of score requests at 1,000 pods).
                    time.sleep(0)
                tracker = stream.tracker
                state = self._state_of(stream, now)
                if state != stream.logged_state:
                    self._log_transition(stream, stream.logged_state, state, now)
                    stream.logged_state = state
                if (
                    state == STATE_DISCONNECTED
                    and not stream.forgotten
                    and now - stream.disconnected_at >= forget_s
                ):
                    stream.forgotten = True  # until it connects again
                    self._intake.submit(stream.ref.pod_id, ControlItem("forget", stream.ref), force=True)
                    continue
                if tracker.awaiting is not None:
                    continue
                heard = stream.last_activity_at()
                if heard is not None and heard > stream.last_probe_at and now - heard >= quiet_s:
                    self._probe(stream, now)
                elif tracker.needs_check and now >= stream.next_check_at:
                    stream.check_interval_s = min(
                        _MAX_CHECK_INTERVAL_S, max(quiet_s, 2 * stream.check_interval_s)
                    )
                    stream.next_check_at = now + stream.check_interval_s
                    self._probe(stream, now)

    def _log_transition(self, stream: Stream, old: str | None, new: str, now: float) -> None:
        """Once per state change: WARNING for every state but live (INFO), with the likely cause."""
        if old is None and (
            new == STATE_REPLAYING or (new == STATE_DISCONNECTED and not stream.ever_connected)
        ):
            return  # where every stream starts: its first real transition is what an operator needs
        pod, tracker = stream.ref, stream.tracker
        cause = _likely_cause(stream, new, now, self.settings)
        level = logging.INFO if new == STATE_LIVE else logging.WARNING
        log.log(
            level,
            "pod %s rank %d: %s -> %s at seq %s%s",
            pod.pod_id,
            pod.dp_rank,
            old or "new",
            new,
            tracker.last_applied,
            f" ({cause})" if cause else "",
        )

    def _probe(self, stream: Stream, now: float) -> None:
        # `now` was read before the stream's timestamps: activity stamped after it is probed again.
        stream.last_probe_at = now
        self._intake.submit(stream.ref.pod_id, ControlItem("probe", stream.ref), force=True)
