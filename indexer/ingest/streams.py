"""The ingest pipeline's shared vocabulary: one `Stream` per (pod, dp rank) publisher, the table of them,
and the two kinds of work the poller hands a pod's worker (a live message, a control request)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import Literal

import msgspec
from kvindex.indexer.decode import DecodedBatch
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest.snapshot_fetcher import SnapshotResult
from kvindex.replay.replay_client import ReplayResult
from kvindex.replay.sequence import SequenceTracker


class LiveItem(msgspec.Struct, frozen=True):
    """A raw live message handed from the poller to a pod's worker (decoded there, not on the poller)."""

    source_id: str
    model: str
    seq: int
    payload: bytes


# own / disown: this replica took / lost the pod's ingest lease (indexer/ingest/leases.py).
ControlKind = Literal["join", "probe", "reconnect", "forget", "unverified", "own", "disown"]


class ControlItem(msgspec.Struct, frozen=True):
    kind: ControlKind
    ref: PodRef


class ReplayDone(msgspec.Struct, frozen=True):
    """A replay's answer, from the replay fetcher's thread back onto the pod's ordered queue."""

    ref: PodRef
    token: int  # which request of the stream it answers (a newer request makes older answers stale)
    result: ReplayResult


class SnapshotDone(msgspec.Struct, frozen=True):
    """A snapshot load's answer, from the snapshot fetcher's pool back onto the pod's ordered queue."""

    ref: PodRef
    token: int  # shares the stream's replay_token: one outstanding request of either kind
    result: SnapshotResult


WorkItem = LiveItem | ControlItem | ReplayDone | SnapshotDone

# What the tracker carries per seq: the batch decoded without token ids and its payload (decoded again
# in full only when the hash check samples it), or None when the payload could not be decoded (its seq
# is still consumed, so it does not look like a gap forever).
TrackedBatch = tuple[DecodedBatch, bytes] | None


class Stream:
    """One (pod, dp rank) publisher: its tracker and its status. Touched by its pod's worker only,
    except for plain attribute reads by the service's status and the poller's link flags."""

    # Slots, the score path's fields first: a score answer reads ~200 streams' state, each a few cache
    # lines away when the fields sat in a dict.
    __slots__ = (
        "last_event_at",
        "tracker",
        "connect_mode",
        "connected",
        "hash_mismatch",
        "owned",
        "ref",
        "model",
        "endpoint",
        "replay_endpoint",
        "snapshot_url",
        "snapshot_id",
        "snapshots_loaded",
        "snapshot_check_due",
        "ever_connected",
        "created_at",
        "connected_at",
        "disconnected_at",
        "forgotten",
        "logged_state",
        "last_probe_at",
        "next_check_at",
        "check_interval_s",
        "events_total",
        "replays_total",
        "indexed_seq",
        "counted",
        "replay_token",
        "hash_checks_total",
        "hash_mismatches_total",
        "sidecar_hash_mismatches",
        "logged",
        "own_pending",
        "joined",
    )

    def __init__(
        self,
        ref: PodRef,
        model: str,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        connect_mode: bool,
        snapshot_url: str | None = None,
    ) -> None:
        self.ref = ref
        self.model = model
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        # A sidecar's GET /v1/snapshot: joins and gaps older than the ring load it (exact, not flagged).
        self.snapshot_url = snapshot_url
        # The sidecar_id of the last snapshot loaded (a new one: the sidecar restarted).
        self.snapshot_id: str | None = None
        self.snapshots_loaded = 0
        # An AllBlocksCleared arrived from the sidecar: load its snapshot (for its partial flag) next.
        self.snapshot_check_due = False
        # Connect mode: kvindex dials this stream's own SUB (its link state is this stream's). Bind mode:
        # the engine dialled a shared bound SUB, and ZMQ does not say which engine a link event is for.
        self.connect_mode = connect_mode
        self.tracker: SequenceTracker[TrackedBatch] = self.new_tracker()
        self.connected = False
        self.ever_connected = False
        self.created_at = time.monotonic()
        # When it last brought events, live or in a replay (None: never): its age, and silent after.
        self.last_event_at: float | None = None
        self.connected_at: float | None = None
        # Since when the stream's link has been down (its creation until it first connects).
        self.disconnected_at: float = self.created_at
        # Its entries were dropped after a long disconnection (reset when it connects again).
        self.forgotten = False
        # The state last logged (transitions are logged once each by the watch thread).
        self.logged_state: str | None = None
        # When the watch last asked for a probe. Heard from or connected after it: probe it once it has
        # been quiet a while (timestamps, not a flag the watch clears, so a connection that lands while
        # a probe is being asked is never lost).
        self.last_probe_at = 0.0
        # While its checks go unanswered (tracker.needs_check): when to probe next, and the interval.
        self.next_check_at = 0.0
        self.check_interval_s = 0.0
        self.events_total = 0
        self.replays_total = 0
        # The newest seq whose events are in the index (the tracker's last_applied runs ahead of it by
        # what a worker has gathered but not yet applied).
        self.indexed_seq: int | None = None
        # The tracker's (gaps, duplicates, history_lost) already added to the process-wide counters.
        self.counted = (0, 0, 0)
        # The stream's outstanding replay request (answers carrying another token are stale).
        self.replay_token = 0
        self.hash_checks_total = 0
        self.hash_mismatches_total = 0
        # Mismatches its sidecar reported in the last snapshot (already in hash_mismatches_total).
        self.sidecar_hash_mismatches = 0
        self.hash_mismatch = False
        self.logged: set[str] = set()
        # Replicas sharing a store: whether this process ingests the stream (holds its lease and has
        # joined under it; written by its worker), and whether an `own` item is on its way (set by the
        # lease manager, cleared by the worker). Always owned without leases.
        self.owned = True
        self.own_pending = False
        # Its first sync is in the index (written by its worker after the join's batches are applied:
        # the tracker's own `joined` turns True before them, and ready must not be read in between).
        self.joined = False

    def last_activity_at(self) -> float | None:
        """The newest of its last events (live or replayed) and its last connection (None: neither yet)."""
        events, connected = self.last_event_at, self.connected_at
        if events is None or connected is None:
            return connected if events is None else events
        return max(events, connected)

    def new_tracker(self) -> SequenceTracker[TrackedBatch]:
        """A fresh sequence tracker for this stream (at creation, and when its past is let go)."""
        return SequenceTracker(
            replayable=self.replay_endpoint is not None, snapshot=self.snapshot_url is not None
        )


class StreamTable:
    """Every stream by (pod, rank), and connect-mode streams by their subscriber source id.

    Connect-mode streams are fixed at construction; bind-mode streams are added by workers on their first
    message. Readers on other threads take `list()` copies under the lock.
    """

    def __init__(self, *, leased: bool = False) -> None:
        # Streams of a replica sharing a store start unowned: the lease manager hands them over.
        self.leased = leased
        self._lock = threading.Lock()
        self._by_ref: dict[PodRef, Stream] = {}
        # The stream of a ref, or None: the dict's own get (a score answer looks up every scored pod).
        self.get = self._by_ref.get
        # Read on the poller's hot path without the lock (never written after start).
        self.by_source: dict[str, Stream] = {}

    def add_connect(self, source_id: str, stream: Stream) -> None:
        if stream.ref in self._by_ref:
            raise ValueError(f"pod {stream.ref.pod_id!r} dp rank {stream.ref.dp_rank} is configured twice")
        stream.owned = not self.leased
        self._by_ref[stream.ref] = stream
        self.by_source[source_id] = stream

    def add_bound(self, stream: Stream) -> Stream:
        """Add a bind-mode stream unless one with its ref exists; the stream that is in the table."""
        stream.owned = not self.leased
        with self._lock:
            return self._by_ref.setdefault(stream.ref, stream)

    @property
    def by_ref(self) -> Mapping[PodRef, Stream]:
        """Every stream by ref, read in place (streams are added, never removed)."""
        return self._by_ref

    def all(self) -> list[Stream]:
        with self._lock:
            return list(self._by_ref.values())

    def bound(self) -> Iterator[Stream]:
        return (stream for stream in self.all() if not stream.connect_mode)

    def __len__(self) -> int:
        return len(self._by_ref)
