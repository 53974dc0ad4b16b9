"""The write path, assembled: subscribers -> frames -> per-pod ordered queues -> sequence check
(gap -> replay, restart -> clear) -> decode -> domain events -> index apply.

`IngestService` is the one object the HTTP API and the CLI hold: it owns the per-model indexes and
hashers, the subscriber thread, the per-pod workers and a small watch thread (quiet probes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Sequence

import msgspec
import xxhash
import zmq
from kvindex.hashing import BlockHasher
from kvindex.indexer.decode import DecodedBatch, DecodeError, decode_batch
from kvindex.indexer.events import (
    PREFIX_SPEC_KINDS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    PodRef,
)
from kvindex.indexer.hash_check import (
    HashCheckSampler,
    could_be_checkable,
    diagnose_mismatch,
    hashes_agree,
    is_checkable,
)
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest.pod_queues import PodQueues
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import (
    STATE_DISCONNECTED,
    STATE_HASH_MISMATCH,
    STATE_LIVE,
    STATE_REPLAYING,
    STATE_RESYNCING,
    STATE_SILENT,
    IngestCounters,
    PodStatus,
)
from kvindex.replay.endpoints import offset_endpoint_port
from kvindex.replay.frames import FrameError, parse_live
from kvindex.replay.replay_client import replay_from
from kvindex.replay.sequence import Action, Apply, ClearPod, FetchReplay, ReplayedItem, SequenceTracker
from kvindex.replay.subscriber import LinkEvent, Subscriber

log = logging.getLogger(__name__)

TOPIC_PREFIX = "kv"
_LISTEN_SOURCE = "listen"
_WATCH_INTERVAL_S = 0.1
# Payload bytes handled between two releases of free heap memory (see `_release_free_heap`).
RELEASE_HEAP_AFTER_BYTES = 32 << 20


def _find_malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's malloc_trim, or None (musl, macOS): releasing free heap pages is then left to the allocator."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MALLOC_TRIM = _find_malloc_trim()
# A payload's digest for the sequence tracker (a duplicate vs a restarted engine's new batch). xxh3 runs
# at ~15 GB/s where zlib's crc32 ran at ~3 GB/s: 0.24 s of worker time per 1M blocks before.
_digest = xxhash.xxh3_64_intdigest


class IngestSettings(msgspec.Struct, frozen=True):
    """How the write path runs. Built once at start-up.

    Bind mode (`listen`): an engine dials in with topic `kv@<pod>@<model>` (split on the first two `@`:
    pod ids cannot contain `@`, model names may). Its replay endpoint is `listen_replay_template` with
    `{pod}` and `{model}` filled in, then vLLM's data-parallel offset applied for the batch's dp rank r > 0
    (`tcp://host:P` -> `tcp://host:P+r`, `inproc://X` -> `inproc://X_dp{r}`), exactly as vLLM offsets the
    engine's own `replay_endpoint`. Example: `tcp://{pod}:5558` reaches pod `engine-3` rank 1 at
    `tcp://engine-3:5559`. None: bind-mode pods have no replay (gaps are then lost history).

    Replays run on the pod's worker, bounded by `replay_timeout_s`: a slow replay delays the other pods
    that share that worker (FNV-1a of the pod id modulo `num_workers`).
    """

    # Per-pod ordered workers; a pod always maps to one (FNV-1a of pod id). One by default: under the
    # GIL more workers did not ingest faster (100 pods x 10k blocks: 1/2/4 within noise per CPU-second)
    # but kept the GIL busier, and lookups during ingest went from p50 ~1 ms (1 worker) to 6-9 ms (2, 4).
    # Raise it when replays can be slow: a replay (<= replay_timeout_s) delays every pod on its worker.
    num_workers: int = 1
    queue_size: int = 10_000  # messages per worker queue; overflow becomes a gap repaired by replay
    # A full queue holds the poller up to this long (messages wait in ZMQ's buffers meanwhile) before a
    # message is dropped: a burst then costs latency, not a gap (which a pod without replay can't repair).
    queue_full_wait_s: float = 2.0
    max_batch: int = 64  # messages a worker takes per wakeup (one index.apply per pod among them)
    silent_after_s: float = 60.0  # connected but nothing received for this long -> state `silent`
    quiet_probe_after_s: float = 5.0  # probe the replay socket when a pod went quiet after activity
    replay_timeout_s: float = 2.0
    hash_check_every: int = 64  # recompute hashes of 1 in N eligible BlockStored events
    index_shards: int = 1  # under the GIL more shards only add routing work (see KVIndex)
    index_max_keys: int = 50_000_000
    index_max_pods_per_key: int = 256
    # Bind mode: replay endpoint of a pod that dialled in, from its topic `kv@<pod>@<model>`;
    # placeholders {pod}, {model}; vLLM's DP port offset is applied for ranks > 0. None: no replay.
    listen_replay_template: str | None = None
    rcvhwm: int = 100_000  # per SUB socket; a full one drops at the PUB (repaired by replay)
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000


DEFAULT_SETTINGS = IngestSettings()


class ModelRuntime:
    """One model's index and hasher (the model's block size and hash settings hash its requests)."""

    config: ModelConfig
    hasher: BlockHasher
    index: KVIndex

    def __init__(self, config: ModelConfig, settings: IngestSettings) -> None:
        self.config = config
        self.hasher = BlockHasher(algo=config.hash_algo, block_size=config.block_size, seed=config.hash_seed)
        self.index = KVIndex(
            num_shards=settings.index_shards,
            max_keys=settings.index_max_keys,
            max_pods_per_key=settings.index_max_pods_per_key,
        )


class _Live(msgspec.Struct, frozen=True):
    """A raw live message handed from the poller to a pod's worker."""

    source_id: str
    model: str
    seq: int
    payload: bytes


class _Control(msgspec.Struct, frozen=True):
    kind: str  # "join" | "probe" | "reconnect"
    ref: PodRef | None  # None: every bind-mode stream of the pod


# What the tracker carries per seq: the batch decoded without token ids and its payload (decoded again
# in full only when the hash check samples it), or None when the payload could not be decoded (its seq
# is still consumed, so it does not look like a gap forever).
_Item = tuple[DecodedBatch, bytes] | None


class _Stream:
    """One (pod, dp rank) publisher: its tracker and its status. Touched by its pod's worker only,
    except for plain attribute reads by `pod_statuses`."""

    def __init__(self, ref: PodRef, model: str, endpoint: str, replay_endpoint: str | None) -> None:
        self.ref = ref
        self.model = model
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.tracker: SequenceTracker[_Item] = SequenceTracker()
        self.connected = False
        self.ever_connected = False
        self.created_at = time.monotonic()
        self.last_live_at: float | None = None
        self.active_since_probe = False
        self.events_total = 0
        self.replays_total = 0
        self.hash_mismatches_total = 0
        self.hash_mismatch = False
        self.logged: set[str] = set()


class _Counters:
    """IngestCounters behind a lock (several workers update them; `lock` + `values` for bulk updates)."""

    def __init__(self) -> None:
        self.lock = self._lock = threading.Lock()
        self.values = self._values = IngestCounters(events_applied={}, dropped={}, replays={})

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._values, name, getattr(self._values, name) + n)

    def add_to(self, name: str, key: str, n: int = 1) -> None:
        with self._lock:
            table: dict[str, int] = getattr(self._values, name)
            table[key] = table.get(key, 0) + n

    def snapshot(self) -> IngestCounters:
        with self._lock:
            return msgspec.convert(msgspec.to_builtins(self._values), IngestCounters)


class IngestService:
    """Subscribes to every pod, keeps each model's index in step with its pods' event streams.

    Connect mode: one SUB per `PodConfig` (a (pod, dp rank) stream). Bind mode (`listen`, one endpoint or
    several): one bound SUB per endpoint that engines dial — several because vLLM offsets the PUB
    endpoint by the DP rank too (rank r of `tcp://kvindex:5557` dials 5557+r); every bound SUB accepts
    any pod and rank, streams appear on their first message. Either way each stream first replays its
    engine's ring from seq 0 (state `replaying`; `ready()` is False meanwhile). With neither pods nor
    listen the service is an empty shell around the indexes (tools fill them directly): it starts and
    is ready at once.
    """

    def __init__(
        self,
        models: Sequence[ModelConfig],
        pods: Sequence[PodConfig] = (),
        *,
        listen: str | Sequence[str] | None = None,
        settings: IngestSettings = DEFAULT_SETTINGS,
    ) -> None:
        if not models:
            raise ValueError("at least one model is needed")
        self.settings = settings
        self.listen: tuple[str, ...] = (listen,) if isinstance(listen, str) else tuple(listen or ())
        self._models: dict[str, ModelRuntime] = {}
        for config in models:
            if config.name in self._models:
                raise ValueError(f"model {config.name!r} is configured twice")
            self._models[config.name] = ModelRuntime(config, settings)
        self._streams: dict[PodRef, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._source_streams: dict[str, _Stream] = {}
        for pod in pods:
            if pod.model not in self._models:
                raise ValueError(f"pod {pod.pod_id!r} names model {pod.model!r}, which is not configured")
            if "@" in pod.pod_id:
                raise ValueError(f"pod id {pod.pod_id!r} must not contain '@'")
            ref = PodRef(pod.pod_id, pod.dp_rank)
            if ref in self._streams:
                raise ValueError(f"pod {pod.pod_id!r} dp rank {pod.dp_rank} is configured twice")
            stream = _Stream(ref, pod.model, pod.endpoint, pod.replay_endpoint)
            self._streams[ref] = stream
            self._source_streams[f"pod:{pod.pod_id}:{pod.dp_rank}"] = stream
        self._counters = _Counters()
        self._sampler = HashCheckSampler(settings.hash_check_every)
        self._logged_once: set[str] = set()
        # Payload bytes handled since free heap memory was last handed back (a heuristic shared by the
        # workers: a lost update under the GIL only delays a release).
        self._bytes_since_release = 0
        self._listen_peers = 0
        # Bind-mode source id -> the resolved address engines dial (what their status shows).
        self._listen_sources: dict[str, str] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq allows 1,023 sockets per context by default; each connect-mode pod costs a SUB and a
        # monitor pair, and replays open DEALERs, so a 1,000-pod fleet needs more (set before any socket).
        self._ctx.set(zmq.MAX_SOCKETS, max(1024, 4 * len(pods) + 4 * len(self.listen) + 256))
        self._queues: PodQueues[_Live | _Control] = PodQueues(
            self._handle,
            num_workers=settings.num_workers,
            queue_size=settings.queue_size,
            handle_many=self._handle_many,
            max_batch=settings.max_batch,
        )
        self._subscriber = Subscriber(
            self._on_frames,
            self._on_link,
            ctx=self._ctx,
            rcvhwm=settings.rcvhwm,
            reconnect_ivl_ms=settings.reconnect_ivl_ms,
            reconnect_ivl_max_ms=settings.reconnect_ivl_max_ms,
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
        for source_id, stream in self._source_streams.items():
            self._subscriber.add_connect(source_id, stream.endpoint)
        for idx, endpoint in enumerate(self.listen):
            source_id = f"{_LISTEN_SOURCE}:{idx}"
            self._listen_sources[source_id] = self._subscriber.add_bind(source_id, endpoint)
        self._queues.start()
        for stream in self._source_streams.values():
            self._submit(stream.ref.pod_id, _Control("join", stream.ref))
        self._subscriber.start()
        self._watch_thread = threading.Thread(target=self._watch, name="kvindex-ingest-watch", daemon=True)
        self._watch_thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close subscriptions and stop workers; idempotent."""
        if self._state == "stopped":
            return
        was_running = self._state == "running"
        self._state = "stopped"
        self._stop_event.set()
        subscriber_stopped = self._subscriber.stop(timeout_s)
        workers_stopped = self._queues.stop(timeout_s) if was_running else True
        if self._watch_thread is not None:
            self._watch_thread.join(timeout_s)
        if subscriber_stopped and workers_stopped:
            self._ctx.destroy(linger=0)
        else:
            log.warning("ingest threads did not stop within %.1f s; leaving the ZMQ context open", timeout_s)

    # -- queries --------------------------------------------------------------------------------

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
        return self._models.get(name)

    def model_names(self) -> list[str]:
        return sorted(self._models)

    def pod_statuses(self) -> list[PodStatus]:
        now = time.monotonic()
        with self._streams_lock:
            streams = sorted(self._streams.values(), key=lambda s: s.ref)
        return [self._status(stream, now) for stream in streams]

    def applied_seqs(self) -> dict[PodRef, int | None]:
        """Each stream's last applied seq (cheap: no index reads; for progress checks and benchmarks)."""
        with self._streams_lock:
            return {ref: stream.tracker.last_applied for ref, stream in self._streams.items()}

    def counters(self) -> IngestCounters:
        """A snapshot of the process-wide counters."""
        return self._counters.snapshot()

    def ready(self) -> bool:
        """Subscriptions up and no pod in its initial sync."""
        if self._state != "running":
            return False
        with self._streams_lock:
            streams = list(self._streams.values())
        return all(stream.tracker.joined for stream in streams)

    def _status(self, stream: _Stream, now: float) -> PodStatus:
        tracker = stream.tracker
        return PodStatus(
            pod=stream.ref.pod_id,
            model=stream.model,
            dp_rank=stream.ref.dp_rank,
            endpoint=stream.endpoint,
            state=self._state_of(stream, now),
            last_seq=tracker.last_applied,
            last_event_age_s=None if stream.last_live_at is None else now - stream.last_live_at,
            events_total=stream.events_total,
            gaps_total=tracker.num_gaps,
            replays_total=stream.replays_total,
            blocks=self._models[stream.model].index.pod_block_count(stream.ref),
            hash_mismatches_total=stream.hash_mismatches_total,
            partial_view=tracker.partial_view,
            restarts_total=tracker.num_restarts,
        )

    def _state_of(self, stream: _Stream, now: float) -> str:
        connected = stream.connected if stream.ref in self._connect_refs() else self._listen_peers > 0
        if not connected:
            return STATE_DISCONNECTED
        if not stream.tracker.joined:
            return STATE_REPLAYING
        if stream.hash_mismatch:
            return STATE_HASH_MISMATCH
        if stream.tracker.resyncing:
            return STATE_RESYNCING
        last_heard = stream.last_live_at if stream.last_live_at is not None else stream.created_at
        if now - last_heard > self.settings.silent_after_s:
            return STATE_SILENT
        return STATE_LIVE

    def _connect_refs(self) -> set[PodRef]:
        return {stream.ref for stream in self._source_streams.values()}

    # -- poller thread: frames -> queues (no decoding here) ---------------------------------------

    def _on_frames(self, source_id: str, frames: list[bytes]) -> None:
        stream = self._source_streams.get(source_id)
        if stream is not None and len(frames) == 3 and len(frames[1]) == 8:
            # Connect mode, well-formed (what parse_live would accept): no intermediate message object.
            seq = int.from_bytes(frames[1], "big")
            self._submit(stream.ref.pod_id, _Live(source_id, stream.model, seq, frames[2]), from_poller=True)
            return
        try:
            message = parse_live(frames)
        except FrameError as exc:
            self._drop(exc.reason, f"{source_id}: {exc.detail}")
            return
        if stream is not None:
            self._submit(stream.ref.pod_id, _Live(source_id, stream.model, message.seq, message.payload), from_poller=True)
            return
        parts = message.topic.decode("utf-8", "replace").split("@", 2)
        if len(parts) != 3 or parts[0] != TOPIC_PREFIX or not parts[1] or not parts[2]:
            self._drop("bad_topic", f"topic {message.topic!r} is not kv@<pod>@<model> (seq {message.seq})")
            return
        _, pod_id, model = parts
        if model not in self._models:
            self._drop("unknown_model", f"pod {pod_id} publishes model {model!r}, which is not configured")
            return
        self._submit(pod_id, _Live(source_id, model, message.seq, message.payload), from_poller=True)

    def _on_link(self, source_id: str, event: LinkEvent) -> None:
        stream = self._source_streams.get(source_id)
        if stream is not None:
            stream.connected = event == "connected"
            if event == "connected":
                if stream.ever_connected:
                    self._submit(stream.ref.pod_id, _Control("reconnect", stream.ref), from_poller=True)
                stream.ever_connected = True
            return
        # Bind mode: ZMQ does not say which engine came or went.
        if event == "connected":
            self._listen_peers += 1
            with self._streams_lock:
                bind_refs = [ref for ref in self._streams if ref not in self._connect_refs()]
            for ref in bind_refs:
                self._submit(ref.pod_id, _Control("reconnect", ref), from_poller=True)
        else:
            self._listen_peers = max(0, self._listen_peers - 1)

    def _submit(self, pod_id: str, item: _Live | _Control, *, from_poller: bool = False) -> None:
        # Only the poller thread may wait for room (PodQueues allows one waiting submitter).
        wait_s = self.settings.queue_full_wait_s if from_poller else 0.0
        if not self._queues.submit(pod_id, item, wait_s=wait_s):
            # The stream sees a gap at its next message (or the quiet probe) and replays it.
            seq = item.seq if isinstance(item, _Live) else None
            self._drop("queue_full", f"pod {pod_id}: worker queue full, message seq {seq} dropped")

    def _drop(self, reason: str, detail: str) -> None:
        self._counters.add_to("dropped", reason)
        self._log_once(f"drop:{reason}:{detail.split(':')[0]}", "dropped (%s): %s", reason, detail)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            log.warning(message, *args)

    # -- watch thread: quiet probes ---------------------------------------------------------------

    def _watch(self) -> None:
        quiet_s = self.settings.quiet_probe_after_s
        bytes_at_last_tick = 0
        while not self._stop_event.wait(min(_WATCH_INTERVAL_S, quiet_s / 4)):
            # Ingest went idle after a burst smaller than the worker's own release threshold: hand the
            # freed payload pages back now rather than keeping them resident until the next burst.
            pending = self._bytes_since_release
            if pending and pending == bytes_at_last_tick and not self._queues.depth():
                self._release_free_heap()
                pending = 0
            bytes_at_last_tick = pending
            now = time.monotonic()
            with self._streams_lock:
                streams = list(self._streams.values())
            for stream in streams:
                last = stream.last_live_at
                if stream.active_since_probe and last is not None and now - last >= quiet_s:
                    stream.active_since_probe = False
                    self._submit(stream.ref.pod_id, _Control("probe", stream.ref))

    # -- workers: one pod's items, in order ---------------------------------------------------------

    def _handle(self, pod_id: str, item: _Live | _Control) -> None:
        self._handle_many([(pod_id, item)])

    def _handle_many(self, entries: list[tuple[str, _Live | _Control]]) -> None:
        """Everything a worker drained, in order. Kept events are gathered per stream and applied with
        one `index.apply` per stream (flushed early before anything that must see them: a clear, a
        replay, an AllBlocksCleared); counters are added once per call."""
        acc = _Accumulator()
        try:
            for pod_id, item in entries:
                try:
                    if type(item) is _Live:
                        self._handle_live(pod_id, item, acc)
                    else:
                        self._handle_control(item, acc)  # type: ignore[arg-type]
                except Exception:
                    log.exception("ingest worker failed on an item of pod %s", pod_id)
        finally:
            self._flush_all(acc)
        if self._bytes_since_release >= RELEASE_HEAP_AFTER_BYTES and not self._queues.depth():
            self._release_free_heap()

    def _release_free_heap(self) -> None:
        """Hand free heap pages back to the OS once a burst has drained.

        NOTE: payloads (a few KB each, glibc's heap) queue up while the worker lags the poller and are
        freed once applied, but the heap cannot shrink past the index's own later allocations: after 1M
        pairs ingested in one burst ~65 MiB stayed free yet resident (~65 B per pair, 40% of the RSS).
        malloc_trim returns whole free pages from anywhere in the heap (madvise), a few ms, GIL released.
        """
        self._bytes_since_release = 0
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)

    def _handle_live(self, pod_id: str, item: _Live, acc: _Accumulator) -> None:
        self._bytes_since_release += len(item.payload)
        decoded = self._decode(pod_id, item.seq, item.payload)
        stream = self._source_streams.get(item.source_id)
        if stream is None:
            stream = self._bind_stream(pod_id, item.model, decoded, item.source_id)
        stream.last_live_at = time.monotonic()
        stream.active_since_probe = True
        actions = stream.tracker.on_live(item.seq, decoded, _digest(item.payload))
        if len(actions) == 1 and type(actions[0]) is Apply:  # the common case: next seq, nothing else
            self._apply(stream, actions[0].seq, actions[0].item, acc)
        elif actions:
            self._perform(stream, actions, acc)

    def _handle_control(self, item: _Control, acc: _Accumulator) -> None:
        stream = self._streams.get(item.ref) if item.ref is not None else None
        if stream is None:
            return
        if item.kind == "join":
            self._perform(stream, stream.tracker.begin_join(), acc)
        elif item.kind == "probe":
            self._perform(stream, stream.tracker.begin_probe(), acc)
        elif item.kind == "reconnect":
            stream.tracker.on_reconnect()

    def _bind_stream(self, pod_id: str, model: str, decoded: _Item, source_id: str) -> _Stream:
        rank = decoded[0].batch.dp_rank if decoded is not None and decoded[0].batch.dp_rank is not None else 0
        ref = PodRef(pod_id, rank)
        stream = self._streams.get(ref)
        if stream is not None:
            return stream
        template = self.settings.listen_replay_template
        replay_endpoint = None
        if template is not None:
            replay_endpoint = offset_endpoint_port(template.format(pod=pod_id, model=model), rank)
        stream = _Stream(ref, model, self._listen_sources.get(source_id, ""), replay_endpoint)
        with self._streams_lock:
            self._streams[ref] = stream
        log.info(
            "pod %s dp rank %d (model %s) dialled in; replay endpoint %s",
            pod_id,
            rank,
            model,
            replay_endpoint,
        )
        return stream

    def _decode(self, pod_id: str, seq: int, payload: bytes) -> _Item:
        """Decode without token ids (most of the bytes; only the hash check needs them, and it decodes
        its sampled batches again in full)."""
        try:
            decoded = decode_batch(payload, with_token_ids=False)
        except DecodeError as exc:
            self._drop(f"decode_{exc.reason}", f"pod {pod_id}: seq {seq} unreadable: {exc}")
            return None
        if decoded.dropped:
            for reason, n in decoded.dropped.items():
                self._counters.add_to("dropped", reason, n)
        return decoded, payload

    def _perform(self, stream: _Stream, actions: list[Action[_Item]], acc: _Accumulator) -> None:
        tracker = stream.tracker
        before = (tracker.num_gaps, tracker.num_duplicates, tracker.num_history_lost)
        self._run_actions(stream, actions, acc)
        # Off the common path (a join, replay, clear or skip): bring the index level with the tracker's
        # state now rather than at the end of the drain, so a status read sees both agree.
        self._flush(stream, acc)
        after = (tracker.num_gaps, tracker.num_duplicates, tracker.num_history_lost)
        for name, old, new in zip(("gaps", "duplicates", "history_lost"), before, after, strict=True):
            if new != old:
                self._counters.add(name, new - old)

    def _run_actions(self, stream: _Stream, actions: list[Action[_Item]], acc: _Accumulator) -> None:
        while actions:
            next_actions: list[Action[_Item]] = []
            for action in actions:
                if isinstance(action, Apply):
                    self._apply(stream, action.seq, action.item, acc)
                elif isinstance(action, ClearPod):
                    self._flush(stream, acc)
                    self._clear(stream, action)
                elif isinstance(action, FetchReplay):
                    self._flush(stream, acc)  # what we have is indexed while the replay runs
                    next_actions = self._replay(stream, action)
            actions = next_actions

    def _replay(self, stream: _Stream, request: FetchReplay) -> list[Action[_Item]]:
        pod = stream.ref
        if stream.replay_endpoint is None:
            self._counters.add_to("replays", "unavailable")
            if request.purpose == "gap":
                self._log_once(
                    f"noreplay:{pod}", "pod %s rank %d: gap but no replay endpoint", pod.pod_id, pod.dp_rank
                )
            return stream.tracker.on_replay([], False)
        stream.replays_total += 1
        try:
            result = replay_from(
                stream.replay_endpoint,
                request.start_seq,
                timeout_s=self.settings.replay_timeout_s,
                ctx=self._ctx,
            )
        except zmq.ZMQError as exc:
            self._counters.add_to("replays", "error")
            log.warning(
                "pod %s rank %d: replay from seq %d failed: %s",
                pod.pod_id,
                pod.dp_rank,
                request.start_seq,
                exc,
            )
            return stream.tracker.on_replay([], False)
        outcome = "ok" if result.complete else "timeout"
        if result.history_lost and request.purpose != "join":
            outcome = "history_lost"
        self._counters.add_to("replays", outcome)
        log.info(
            "pod %s rank %d: %s replay from seq %d -> %d batches (%s)",
            pod.pod_id,
            pod.dp_rank,
            request.purpose,
            request.start_seq,
            len(result.messages),
            outcome,
        )
        replayed = [
            ReplayedItem(m.seq, self._decode(pod.pod_id, m.seq, m.payload), _digest(m.payload))
            for m in result.messages
        ]
        return stream.tracker.on_replay(replayed, result.complete)

    def _clear(self, stream: _Stream, action: ClearPod) -> None:
        pod = stream.ref
        cleared = self._models[stream.model].index.clear_pod(pod)
        if action.reason == "restart":
            self._counters.add("restarts")
            stream.hash_mismatch = False  # a new engine process may run with new settings
            log.warning(
                "pod %s rank %d: engine restarted; dropped its %d entries", pod.pod_id, pod.dp_rank, cleared
            )
        else:
            log.warning(
                "pod %s rank %d: batches after seq %s are lost (not in the replay ring); dropped %d entries, "
                "state resyncing",
                pod.pod_id,
                pod.dp_rank,
                stream.tracker.last_applied,
                cleared,
            )

    def _apply(self, stream: _Stream, seq: int, decoded: _Item, acc: _Accumulator) -> None:
        """Filter one batch's events for the index and queue them on `acc` (applied at the next flush)."""
        if decoded is None:
            return
        batch, payload = decoded
        runtime = self._models[stream.model]
        config = runtime.config
        block_size = config.block_size
        prefix_groups = config.prefix_group_idxs
        kept = acc.pending.get(stream)
        if kept is None:
            kept = acc.pending[stream] = []
        cleared = False
        for pos, event in enumerate(batch.batch.events):
            kind = type(event)
            if kind is BlocksStored:
                spec_kind = event.spec_kind  # type: ignore[union-attr]
                group_idx = event.group_idx  # type: ignore[union-attr]
                if (spec_kind is not None and spec_kind not in PREFIX_SPEC_KINDS) or (
                    group_idx is not None and group_idx not in prefix_groups
                ):
                    acc.non_prefix += 1
                    continue
                event_block_size = event.block_size  # type: ignore[union-attr]
                if event_block_size != 0 and event_block_size != block_size:
                    self._flag_block_size(stream, seq, event, config)  # type: ignore[arg-type]
                    continue
                if event.parent_key is None:  # type: ignore[union-attr]
                    self._maybe_check_hashes(stream, seq, event, pos, payload, runtime)  # type: ignore[arg-type]
                acc.stored += 1
            elif kind is BlocksRemoved:
                group_idx = event.group_idx  # type: ignore[union-attr]
                if group_idx is not None and group_idx not in prefix_groups:
                    acc.non_prefix += 1
                    continue
                acc.removed += 1
            elif kind is AllBlocksCleared:
                acc.cleared += 1
                cleared = True
            kept.append(event)
        if cleared:
            self._flush(stream, acc)
            stream.tracker.view_complete()

    def _flush(self, stream: _Stream, acc: _Accumulator) -> None:
        events = acc.pending.pop(stream, None)
        if not events:
            return
        stats = self._models[stream.model].index.apply(stream.ref, events)
        acc.unknown_parents += stats.unknown_parents
        stream.events_total += len(events)

    def _flush_all(self, acc: _Accumulator) -> None:
        for stream in list(acc.pending):
            try:
                self._flush(stream, acc)
            except Exception:
                log.exception("ingest worker failed to apply a batch of pod %s", stream.ref.pod_id)
        counters = self._counters
        with counters.lock:
            values = counters.values
            applied = values.events_applied
            for name, n in (
                ("BlockStored", acc.stored),
                ("BlockRemoved", acc.removed),
                ("AllBlocksCleared", acc.cleared),
            ):
                if n:
                    applied[name] = applied.get(name, 0) + n
            values.unknown_parents += acc.unknown_parents
            values.non_prefix_group_events += acc.non_prefix

    def _flag_block_size(self, stream: _Stream, seq: int, event: BlocksStored, config: ModelConfig) -> None:
        self._counters.add("block_size_mismatches")
        stream.hash_mismatch = True
        if "block_size" not in stream.logged:
            stream.logged.add("block_size")
            log.warning(
                "pod %s rank %d seq %d: event block_size %d differs from model %s's %d; not indexed "
                "(set --block-size to the engines' value)",
                stream.ref.pod_id,
                stream.ref.dp_rank,
                seq,
                event.block_size,
                config.name,
                config.block_size,
            )

    def _maybe_check_hashes(
        self, stream: _Stream, seq: int, event: BlocksStored, pos: int, payload: bytes, runtime: ModelRuntime
    ) -> None:
        """Sample, then decode the batch again with its token ids (the hot path skipped them)."""
        config = runtime.config
        if not could_be_checkable(event, config.block_size) or not self._sampler.should_check(stream.ref):
            return
        try:
            events = decode_batch(payload).batch.events
        except DecodeError:
            return
        full = events[pos] if pos < len(events) else None
        # A batch the two decoders read differently (an event only one of them dropped): skip the check.
        if not isinstance(full, BlocksStored) or full.block_keys != event.block_keys:
            return
        if not is_checkable(full, config.block_size) or hashes_agree(full, runtime.hasher):
            return
        stream.hash_mismatches_total += 1
        stream.hash_mismatch = True
        self._counters.add("hash_mismatches")
        if "hash" not in stream.logged:
            stream.logged.add("hash")
            log.warning(
                "pod %s rank %d seq %d: block hashes differ from model %s's settings: %s",
                stream.ref.pod_id,
                stream.ref.dp_rank,
                seq,
                config.name,
                diagnose_mismatch(full, config),
            )


class _Accumulator:
    """What one `_handle_many` call gathered: kept events per stream (in order), and counts."""

    __slots__ = ("pending", "stored", "removed", "cleared", "non_prefix", "unknown_parents")

    def __init__(self) -> None:
        self.pending: dict[_Stream, list[KVEvent]] = {}
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.non_prefix = 0
        self.unknown_parents = 0
