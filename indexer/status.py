"""What the ingest pipeline reports about itself: per-stream status and counters.

Plain values read by the HTTP API (`/v1/pods`) and turned into Prometheus metrics at scrape time by
api/metrics.py, so the write path never pays for metric objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import msgspec
from kvindex.indexer.events import PodRef

if TYPE_CHECKING:
    from kvindex.indexer.registry import ModelRuntime

# Pod states, as CONTRACT.md names them.
STATE_LIVE = "live"
STATE_REPLAYING = "replaying"
STATE_RESYNCING = "resyncing"
STATE_SILENT = "silent"
STATE_HASH_MISMATCH = "hash_mismatch"
STATE_DISCONNECTED = "disconnected"


class PodStatus(msgspec.Struct):
    """One (pod, dp rank) stream, as `GET /v1/pods` shows it."""

    pod: str
    model: str
    dp_rank: int
    endpoint: str
    state: str
    last_seq: int | None
    last_event_age_s: float | None
    events_total: int
    gaps_total: int
    replays_total: int
    blocks: int
    hash_mismatches_total: int
    # Extensions beyond CONTRACT.md (operators asked for them):
    partial_view: bool = False  # joined late and the engine's ring no longer started at seq 0
    restarts_total: int = 0
    # Replicas sharing a store: the replica holding the pod's ingest lease (None: no leases, or free).
    owner: str | None = None


# What a score answer may trust: a pod in this state is following its engine's stream right now.
VOUCHED_STATES = frozenset({STATE_LIVE})
ALL_STATES = (
    STATE_LIVE,
    STATE_REPLAYING,
    STATE_RESYNCING,
    STATE_SILENT,
    STATE_HASH_MISMATCH,
    STATE_DISCONNECTED,
)


class PodHealth(msgspec.Struct, frozen=True):
    """What a score answer says about one (pod, dp rank): cheap to read per scored pod."""

    state: str
    last_event_age_s: float | None
    # How long the link has been down (None while connected).
    disconnected_for_s: float | None


class HealthReader(NamedTuple):
    """What the compiled answer writer (api/_answer.c) needs to read streams' health itself, at one clock
    reading: the common live case on the Stream objects, `slow` (the service's own pod_healths) for the
    rest. A tuple, so C reads it by position."""

    streams: Mapping[PodRef, object]  # every stream by ref (never removed, see StreamTable)
    now: float
    silent_after_s: float
    listen_up: bool  # an engine is connected to a bound SUB (every bind-mode stream's link)
    unowned_matter: bool  # replicas share a store: a stream this one does not own is not live here
    slow: Callable[[PodRef], PodHealth | None]


class Readiness(msgspec.Struct, frozen=True):
    ready: bool
    reason: str | None = None  # why not, in one sentence
    live_pods: int = 0


class IngestCounters(msgspec.Struct):
    """Process-wide counters, monotonically increasing (Prometheus counters)."""

    # event type ("BlockStored" | "BlockRemoved" | "AllBlocksCleared") -> applied events
    events_applied: dict[str, int] = {}
    # reason -> dropped events or messages (decode errors, bad frames, non-prefix groups, ...)
    dropped: dict[str, int] = {}
    gaps: int = 0
    # Extensions: gaps the replay ring could not cover (pod cleared, `resyncing`), and live batches
    # skipped as already applied (normal right after a replay).
    history_lost: int = 0
    duplicates: int = 0
    # outcome ("ok" | "history_lost" | "timeout" | "error") -> replays
    replays: dict[str, int] = {}
    restarts: int = 0
    hash_mismatches: int = 0
    unknown_parents: int = 0
    block_size_mismatches: int = 0
    non_prefix_group_events: int = 0
    # outcome ("ok" | "unavailable" | "invalid" | "wrong_pod") -> sidecar snapshot loads
    snapshots: dict[str, int] = {}


class IngestSettingsView(Protocol):
    """The ingest settings the read path needs (IngestSettings provides them)."""

    @property
    def disconnected_grace_s(self) -> float: ...


class IngestView(Protocol):
    """What the HTTP read path needs of the write path: the model registry, status and counters, and the
    lifecycle when the app owns it. `kvindex.indexer.ingest.IngestService` provides it."""

    def model(self, name: str) -> ModelRuntime | None: ...
    def model_names(self) -> list[str]: ...
    def pod_statuses(self) -> list[PodStatus]: ...
    def pod_health(self, pod_id: str, dp_rank: int) -> PodHealth | None: ...
    def pod_healths(self, refs: Sequence[PodRef], now: float | None = None) -> list[PodHealth | None]: ...
    def health_reader(self) -> HealthReader: ...
    def counters(self) -> IngestCounters: ...
    def ready(self) -> bool: ...
    def readiness(self, min_live_pods: int = 1) -> Readiness: ...

    @property
    def settings(self) -> IngestSettingsView: ...
    def start(self) -> None: ...
    def stop(self, timeout_s: float = 5.0) -> None: ...
