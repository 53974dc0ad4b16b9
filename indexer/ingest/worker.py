"""Write path, stages 3-6: one pod's work items, in order, on its worker thread. Decode -> sequence check
(next -> apply; duplicate -> skip; gap -> replay from the pod's ROUTER; restart or lost history -> clear)
-> filter (non-prefix groups, block-size mismatch, sampled hash check) -> one `index.apply_many` per drain
(one batch per stream).

Replays never run on the worker: a request goes to the replay fetcher (its own thread, every pod's
requests at once) and its answer comes back through the pod's queue as a `ReplayDone`, in order with
the pod's live messages, which the tracker holds meanwhile. One pod's slow replay stalls nobody."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import xxhash
import zmq
from kvindex.indexer.decode import (
    DecodedBatch,
    DecodeError,
    decode_batch,
    read_default_shapes,
    stored_token_ids,
)
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
    is_checkable,
    keys_agree,
)
from kvindex.indexer.ingest.counters import Counters
from kvindex.indexer.ingest.heap import HeapRelease
from kvindex.indexer.ingest.observer import BatchObserver
from kvindex.indexer.ingest.settings import IngestSettings
from kvindex.indexer.ingest.snapshot_fetcher import SnapshotFetcher
from kvindex.indexer.ingest.streams import (
    ControlItem,
    LiveItem,
    ReplayDone,
    SnapshotDone,
    Stream,
    StreamTable,
    TrackedBatch,
    WorkItem,
)
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.registry import ModelRegistry, ModelRuntime
from kvindex.indexer.snapshot import RankSnapshot, SnapshotError, check_snapshot_for
from kvindex.indexer.store import LeaseLost, StoreUnavailable
from kvindex.replay.endpoints import endpoint_problem, offset_endpoint_port
from kvindex.replay.replay_fetcher import ReplayFetcher
from kvindex.replay.sequence import (
    MAX_REPLAY_ATTEMPTS,
    Action,
    Apply,
    ClearPod,
    FetchReplay,
    FetchSnapshot,
    ReplayedItem,
)

log = logging.getLogger("kvindex.indexer.ingest")

# Keys per BlocksStored when a snapshot is loaded into the index (bounds one apply step's size).
_SNAPSHOT_CHUNK = 4096

# A payload's digest for the sequence tracker (a duplicate vs a restarted engine's new batch): xxh3 runs
# several times faster than zlib's crc32 over these payloads.
_digest = xxhash.xxh3_64_intdigest


class _Accumulator:
    """What one `handle_many` call gathered: kept events per stream (in order), and counts."""

    __slots__ = ("pending", "pending_seq", "stored", "removed", "cleared", "non_prefix", "unknown_parents")

    def __init__(self) -> None:
        self.pending: dict[Stream, list[KVEvent]] = {}
        # The newest seq whose events are gathered in `pending` (or had none to keep).
        self.pending_seq: dict[Stream, int] = {}
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.non_prefix = 0
        self.unknown_parents = 0


class StreamWorker:
    """Applies work items to the streams and indexes. One instance serves every worker thread: a pod's
    items only ever reach one thread (PodQueues), and each stream is touched by its pod's thread only."""

    def __init__(
        self,
        settings: IngestSettings,
        streams: StreamTable,
        models: ModelRegistry,
        counters: Counters,
        ctx: zmq.Context[zmq.Socket[bytes]],
        listen_sources: dict[str, str],
        heap: HeapRelease,
        queue_depth: Callable[[], int],
        fetcher: ReplayFetcher,
        snapshot_fetcher: SnapshotFetcher | None = None,
        observer: BatchObserver | None = None,
    ) -> None:
        self._settings = settings
        self._streams = streams
        self._models = models
        self._counters = counters
        self._ctx = ctx
        # Bind-mode source id -> the resolved address engines dial (filled by the service at start).
        self._listen_sources = listen_sources
        self._heap = heap
        self._queue_depth = queue_depth
        self._fetcher = fetcher
        self._snapshot_fetcher = snapshot_fetcher
        self._observer = observer
        self._sampler = HashCheckSampler(settings.hash_check_every)

    def handle_many(self, entries: list[tuple[str, WorkItem]]) -> None:
        """Everything a worker drained, in order. Live payloads are read first, all at once (off the GIL,
        see decode.read_default_shapes); kept events are gathered per stream and applied with one
        `apply_many` at the end (a stream is flushed early before anything that must see its events: a
        clear, a replay, an AllBlocksCleared); counters are added once per call."""
        acc = _Accumulator()
        reads = iter(read_default_shapes([item.payload for _, item in entries if type(item) is LiveItem]))
        try:
            for pod_id, item in entries:
                try:
                    if type(item) is LiveItem:
                        self._handle_live(pod_id, item, acc, next(reads))
                    elif type(item) is ReplayDone:
                        self._handle_replay_done(item, acc)
                    elif type(item) is ControlItem:
                        self._handle_control(item, acc)
                    elif type(item) is SnapshotDone:
                        self._handle_snapshot_done(item, acc)
                except (StoreUnavailable, LeaseLost) as exc:
                    self._lose_item_stream(item, exc, acc)
                except Exception:
                    log.exception("ingest worker failed on an item of pod %s", pod_id)
        finally:
            self._flush_all(acc)
        self._heap.after_drain(idle=not self._queue_depth())

    def _handle_live(
        self, pod_id: str, item: LiveItem, acc: _Accumulator, read: DecodedBatch | None = None
    ) -> None:
        """`read`: the payload already read by read_default_shapes (None: decode it here)."""
        self._heap.note(len(item.payload))
        decoded = (read, item.payload) if read is not None else self._decode(pod_id, item.seq, item.payload)
        stream = self._streams.by_source.get(item.source_id)
        if stream is None:
            stream = self._bind_stream(pod_id, item.model, decoded, item.source_id)
            if stream.model != item.model:
                self._switch_model(stream, item.model, acc)
        stream.last_event_at = time.monotonic()
        if not stream.owned:
            return  # another replica ingests this pod (or it rejoins once the store is back)
        actions = stream.tracker.on_live(item.seq, decoded, _digest(item.payload), len(item.payload))
        if len(actions) == 1 and type(actions[0]) is Apply:  # the common case: next seq, nothing else
            self._apply(stream, actions[0].seq, actions[0].item, acc)
        elif actions:
            self._perform(stream, actions, acc)
        else:
            self._sync_counts(stream)  # a duplicate, or held while a replay is out
        if stream.snapshot_check_due:
            self._check_snapshot(stream, acc)

    def _handle_control(self, item: ControlItem, acc: _Accumulator) -> None:
        stream = self._streams.get(item.ref)
        if stream is None:
            return
        if item.kind == "own":
            self._own(stream, acc)
            return
        if item.kind == "disown":
            self._let_go(stream, acc)
            return
        if not stream.owned:
            return  # another replica ingests this pod
        if item.kind == "join":
            self._perform(stream, stream.tracker.begin_join(), acc)
        elif item.kind == "probe":
            self._perform(stream, stream.tracker.begin_probe(), acc)
        elif item.kind == "forget":
            self._forget(stream, acc)
        elif item.kind == "unverified":
            stream.tracker.mark_unverified()
        elif item.kind == "reconnect":
            # Asked once the new connection's subscription has had time to take effect, so the ring's
            # answer and the live stream overlap instead of leaving a hole between them.
            self._perform(
                stream, stream.tracker.on_reconnect(), acc, delay_s=self._settings.reconnect_settle_s
            )

    def _own(self, stream: Stream, acc: _Accumulator) -> None:
        """This replica took the pod's lease: drop whatever the store holds of it (a previous owner's
        view) and join from its ring under the new lease, so the store is exact again."""
        acc.pending.pop(stream, None)
        acc.pending_seq.pop(stream, None)
        self._reset_stream(stream)
        try:
            self._models[stream.model].index.clear_pod(stream.ref)
        except (StoreUnavailable, LeaseLost) as exc:
            stream.own_pending = False
            log.warning(
                "pod %s rank %d: cannot take over yet (%s)", stream.ref.pod_id, stream.ref.dp_rank, exc
            )
            return
        stream.owned = True
        stream.own_pending = False
        self._perform(stream, stream.tracker.begin_join(), acc)

    def _let_go(self, stream: Stream, acc: _Accumulator) -> None:
        """Stop ingesting the pod (its lease is another replica's now, or the store is gone)."""
        acc.pending.pop(stream, None)
        acc.pending_seq.pop(stream, None)
        stream.owned = False
        self._reset_stream(stream)

    def _lose_item_stream(self, item: WorkItem, exc: Exception, acc: _Accumulator) -> None:
        if type(item) is LiveItem:
            stream = self._streams.by_source.get(item.source_id)
        elif type(item) is ControlItem or type(item) is ReplayDone or type(item) is SnapshotDone:
            stream = self._streams.get(item.ref)
        else:
            return
        if stream is not None:
            self._lose(stream, exc, acc)

    def _lose(self, stream: Stream, exc: Exception, acc: _Accumulator) -> None:
        """A write of the pod failed in the shared store (unreachable, restarted, or the lease went): what
        the store holds of it is unknown, so it stops here and, once its lease is (still or again) this
        replica's, is rebuilt from its ring."""
        if stream.owned:
            log.warning(
                "pod %s rank %d: store write failed (%s); rejoins once the store and its lease are back",
                stream.ref.pod_id,
                stream.ref.dp_rank,
                exc,
            )
        self._let_go(stream, acc)

    def _reset_stream(self, stream: Stream) -> None:
        """Let the stream's past go: a fresh tracker (its next message is a join), no outstanding replay."""
        stream.tracker = stream.new_tracker()
        stream.joined = False
        stream.counted = (0, 0, 0)
        stream.indexed_seq = None
        stream.replay_token += 1  # an answer still out is for the stream's past

    def _switch_model(self, stream: Stream, model: str, acc: _Accumulator) -> None:
        """Bind mode: a pod's topic names another model than before (the engine was redeployed with
        it). Its entries go from the old model's index and it joins again under the new one."""
        self._flush(stream, acc)
        self._sync_counts(stream)
        cleared = self._models[stream.model].index.clear_pod(stream.ref)
        if self._observer is not None:
            self._observer.on_clear(stream.ref, "model")
        log.warning(
            "pod %s rank %d: now publishes model %s (was %s); dropped its %d entries and joins again",
            stream.ref.pod_id,
            stream.ref.dp_rank,
            model,
            stream.model,
            cleared,
        )
        stream.model = model
        self._reset_stream(stream)

    def _forget(self, stream: Stream, acc: _Accumulator) -> None:
        """Disconnected past forget_after_s: free the pod's entries; its return is a fresh join."""
        self._flush(stream, acc)
        self._sync_counts(stream)
        cleared = self._models[stream.model].index.clear_pod(stream.ref)
        if self._observer is not None:
            self._observer.on_clear(stream.ref, "forget")
        self._reset_stream(stream)
        log.warning(
            "pod %s rank %d: disconnected for %.0f s; dropped its %d entries (its return is a fresh join)",
            stream.ref.pod_id,
            stream.ref.dp_rank,
            self._settings.forget_after_s,
            cleared,
        )

    def _handle_replay_done(self, item: ReplayDone, acc: _Accumulator) -> None:
        stream = self._streams.get(item.ref)
        request = None if stream is None else stream.tracker.awaiting
        if (
            stream is None
            or not stream.owned
            or item.token != stream.replay_token
            or not isinstance(request, FetchReplay)
        ):
            return  # the answer to a request the stream no longer waits for
        result = item.result
        pod = stream.ref
        for reason, n in result.bad_frames.items():
            self._counters.add_to("dropped", f"replay_{reason}", n)
        if result.error is not None:
            # The request could not even be sent (a malformed endpoint): retrying cannot help.
            log.warning(
                "pod %s rank %d: replay endpoint %s refused (%s); the stream goes without replay",
                pod.pod_id,
                pod.dp_rank,
                stream.replay_endpoint,
                result.error,
            )
            self._counters.add_to("replays", "error")
            stream.replay_endpoint = None
            stream.tracker.replayable = False
            self._perform(stream, stream.tracker.on_replay_unavailable(), acc)
            return
        if not result.complete:
            outcome = "timeout"
        elif result.history_lost and request.purpose != "join":
            outcome = "history_lost"
        else:
            outcome = "ok"
        self._counters.add_to("replays", outcome)
        if result.complete:
            log.info(
                "pod %s rank %d: %s replay from seq %d -> %d batches (%s)",
                pod.pod_id,
                pod.dp_rank,
                request.purpose,
                request.start_seq,
                len(result.messages),
                outcome,
            )
        elif request.attempt + 1 >= MAX_REPLAY_ATTEMPTS:
            self._counters.add_to("replays", "gave_up")
            log.warning(
                "pod %s rank %d: %s replay from seq %d unanswered after %d attempts (%s); going on with "
                "what arrived live, will check again",
                pod.pod_id,
                pod.dp_rank,
                request.purpose,
                request.start_seq,
                request.attempt + 1,
                "timeout",
            )
        replayed = (
            [
                ReplayedItem(m.seq, self._decode(pod.pod_id, m.seq, m.payload), _digest(m.payload))
                for m in result.messages
            ]
            if result.complete
            else []
        )
        actions = stream.tracker.on_replay(replayed, result.complete)
        if any(isinstance(action, Apply) for action in actions):
            # Events received now, though PUB did not bring them (a join, a reconnect, a lost last
            # message): the pod's age says how fresh our view of it is, and this brought it up to date.
            # Not a replay that only repeats what was applied: a probe's answer always repeats the last
            # batch, and stamping that re-probed every quiet pod forever and kept a hung one from silent.
            stream.last_event_at = time.monotonic()
        self._perform(stream, actions, acc)
        if stream.snapshot_check_due:
            self._check_snapshot(stream, acc)

    def _handle_snapshot_done(self, item: SnapshotDone, acc: _Accumulator) -> None:
        """Replace the stream's entries with its sidecar's snapshot and go on after the snapshot's seq;
        a snapshot that cannot be used falls back to the replay path (counted, logged with why)."""
        stream = self._streams.get(item.ref)
        request = None if stream is None else stream.tracker.awaiting
        if (
            stream is None
            or not stream.owned
            or item.token != stream.replay_token
            or not isinstance(request, FetchSnapshot)
        ):
            return
        pod = stream.ref
        result = item.result
        try:
            if result.snapshot is None:
                raise SnapshotError(result.error or "no snapshot")
            rank = check_snapshot_for(result.snapshot, pod.pod_id, stream.model, pod.dp_rank)
            block_size = self._models[stream.model].config.block_size
            if result.snapshot.block_size != block_size:
                raise SnapshotError(
                    f"the snapshot's block size {result.snapshot.block_size} is not the model's {block_size}"
                )
        except SnapshotError as exc:
            outcome = "wrong_pod" if result.outcome == "ok" else result.outcome
            self._counters.add_to("snapshots", outcome)
            log.warning(
                "pod %s rank %d: %s snapshot not loaded (%s); falling back to the replay ring",
                pod.pod_id,
                pod.dp_rank,
                request.purpose,
                exc,
            )
            self._perform(stream, stream.tracker.on_snapshot_failed(), acc)
            return
        self._flush(stream, acc)
        self._load_snapshot(stream, rank)
        new_id = result.snapshot.sidecar_id
        if stream.snapshot_id is not None and new_id != stream.snapshot_id:
            log.warning(
                "pod %s rank %d: its sidecar restarted (snapshot id %s, was %s)",
                pod.pod_id,
                pod.dp_rank,
                new_id,
                stream.snapshot_id,
            )
        stream.snapshot_id = new_id
        stream.snapshots_loaded += 1
        self._counters.add_to("snapshots", "ok")
        stream.snapshot_check_due = False  # this load is the check; clears it applies may ask again
        self._perform(stream, stream.tracker.on_snapshot(rank.seq, partial=rank.partial), acc)
        if stream.snapshot_check_due:
            self._check_snapshot(stream, acc)

    def _load_snapshot(self, stream: Stream, rank: RankSnapshot) -> None:
        """The stream's entries become the snapshot's blocks (a block held n times is stored n times)."""
        pod = stream.ref
        index = self._models[stream.model].index
        cleared = index.clear_pod(pod)
        if self._observer is not None:
            self._observer.on_clear(pod, "snapshot")
        events: list[KVEvent] = []
        num_blocks = 0
        for tier in rank.tiers:
            keys = tier.block_hashes
            num_blocks += len(keys)
            rounds = [keys]
            if tier.copies:
                for n in range(2, max(tier.copies) + 1):
                    rounds.append([k for k, c in zip(keys, tier.copies, strict=True) if c >= n])
            for round_keys in rounds:
                for start in range(0, len(round_keys), _SNAPSHOT_CHUNK):
                    chunk = tuple(round_keys[start : start + _SNAPSHOT_CHUNK])
                    events.append(BlocksStored(chunk, None, (), 0, tier=tier.tier))
        if events:
            index.apply(pod, events)
        stream.indexed_seq = rank.seq
        # The sidecar recomputes every block's hashes: its mismatches are this pod's.
        new_mismatches = rank.hash_mismatches_total - stream.sidecar_hash_mismatches
        if new_mismatches > 0:
            stream.hash_mismatches_total += new_mismatches
            stream.hash_mismatch = True
            self._counters.add("hash_mismatches", new_mismatches)
        stream.sidecar_hash_mismatches = rank.hash_mismatches_total
        log.info(
            "pod %s rank %d: loaded its sidecar's snapshot at seq %s: %d blocks (%d entries replaced)%s",
            pod.pod_id,
            pod.dp_rank,
            rank.seq,
            num_blocks,
            cleared,
            ", partial at the sidecar" if rank.partial else "",
        )

    def _bind_stream(self, pod_id: str, model: str, decoded: TrackedBatch, source_id: str) -> Stream:
        rank = decoded[0].batch.dp_rank if decoded is not None and decoded[0].batch.dp_rank is not None else 0
        ref = PodRef(pod_id, rank)
        stream = self._streams.get(ref)
        if stream is not None:
            return stream
        replay_endpoint = self._bind_replay_endpoint(pod_id, model, rank)
        endpoint = self._listen_sources.get(source_id, "")
        snapshot_template = self._settings.listen_snapshot_template
        snapshot_url = (
            None if snapshot_template is None else snapshot_template.format(pod=pod_id, model=model)
        )
        stream = self._streams.add_bound(
            Stream(ref, model, endpoint, replay_endpoint, connect_mode=False, snapshot_url=snapshot_url)
        )
        log.info(
            "pod %s dp rank %d (model %s) dialled in; replay endpoint %s",
            pod_id,
            rank,
            model,
            replay_endpoint,
        )
        return stream

    def _bind_replay_endpoint(self, pod_id: str, model: str, rank: int) -> str | None:
        """The replay endpoint `listen_replay_template` gives this pod and rank, or None (no template, or
        one that makes no endpoint of this pod's id: said once, and the stream goes without replay)."""
        template = self._settings.listen_replay_template
        if template is None:
            return None
        try:
            endpoint = offset_endpoint_port(template.format(pod=pod_id, model=model), rank)
            problem = None if endpoint is None else endpoint_problem(endpoint, dial=True)
            if problem is not None:
                problem = f"{endpoint!r} {problem}"
        except (ValueError, KeyError, IndexError) as exc:
            endpoint, problem = None, str(exc)
        if problem is not None or endpoint is None:
            self._counters.log_once(
                f"badreplay:{pod_id}:{rank}",
                "pod %s rank %d: --listen-replay %r gives no replay endpoint for it (%s); it goes without replay",
                pod_id,
                rank,
                template,
                problem,
            )
            return None
        return endpoint

    def _decode(self, pod_id: str, seq: int, payload: bytes) -> TrackedBatch:
        """Decode without token ids (most of the bytes; only the hash check needs them, and it decodes
        its sampled batches again in full)."""
        try:
            decoded = decode_batch(payload, with_token_ids=False)
        except DecodeError as exc:
            self._counters.drop(f"decode_{exc.reason}", f"pod {pod_id}: seq {seq} unreadable: {exc}")
            return None
        if decoded.dropped:
            for reason, n in decoded.dropped.items():
                self._counters.add_to("dropped", reason, n)
        return decoded, payload

    def _check_snapshot(self, stream: Stream, acc: _Accumulator) -> None:
        """An AllBlocksCleared came from a sidecar: load its snapshot once nothing else is outstanding."""
        actions = stream.tracker.begin_snapshot_check()
        if actions:
            stream.snapshot_check_due = False
            self._perform(stream, actions, acc)

    def _perform(
        self, stream: Stream, actions: list[Action[TrackedBatch]], acc: _Accumulator, *, delay_s: float = 0.0
    ) -> None:
        self._run_actions(stream, actions, acc, delay_s)
        # Off the common path (a join, replay, clear or skip): bring the index level with the tracker's
        # state now rather than at the end of the drain, so a status read sees both agree.
        self._flush(stream, acc)
        self._sync_counts(stream)

    def _sync_counts(self, stream: Stream) -> None:
        """Add what the stream's tracker counted since the last sync to the process-wide counters."""
        tracker = stream.tracker
        now = (tracker.num_gaps, tracker.num_duplicates, tracker.num_history_lost)
        if now != stream.counted:
            for name, old, new in zip(
                ("gaps", "duplicates", "history_lost"), stream.counted, now, strict=True
            ):
                if new != old:
                    self._counters.add(name, new - old)
            stream.counted = now

    def _run_actions(
        self, stream: Stream, actions: list[Action[TrackedBatch]], acc: _Accumulator, delay_s: float
    ) -> None:
        while actions:
            next_actions: list[Action[TrackedBatch]] = []
            for action in actions:
                if isinstance(action, Apply):
                    self._apply(stream, action.seq, action.item, acc)
                elif isinstance(action, ClearPod):
                    self._flush(stream, acc)
                    self._clear(stream, action)
                elif isinstance(action, FetchReplay):
                    self._flush(stream, acc)  # what we have is indexed while the replay runs
                    next_actions = self._request_replay(stream, action, delay_s)
                elif isinstance(action, FetchSnapshot):
                    self._flush(stream, acc)
                    next_actions = self._request_snapshot(stream)
            actions = next_actions

    def _request_replay(
        self, stream: Stream, request: FetchReplay, delay_s: float
    ) -> list[Action[TrackedBatch]]:
        """Hand the request to the fetcher (its answer returns as a ReplayDone); a retry waits a capped,
        doubling backoff. Without a replay endpoint the tracker goes on with what it has, at once."""
        pod = stream.ref
        if stream.replay_endpoint is None:
            self._counters.add_to("replays", "unavailable")
            if request.purpose == "gap":
                self._counters.log_once(
                    f"noreplay:{pod}", "pod %s rank %d: gap but no replay endpoint", pod.pod_id, pod.dp_rank
                )
            return stream.tracker.on_replay_unavailable()
        if request.attempt:
            settings = self._settings
            delay_s = max(
                delay_s,
                min(settings.replay_retry_max_s, settings.replay_retry_base_s * 2 ** (request.attempt - 1)),
            )
        stream.replays_total += 1
        stream.replay_token += 1
        self._fetcher.request(
            (pod, stream.replay_token), stream.replay_endpoint, request.start_seq, delay_s=delay_s
        )
        return []

    def _request_snapshot(self, stream: Stream) -> list[Action[TrackedBatch]]:
        """Hand the load to the snapshot fetcher (its answer returns as a SnapshotDone)."""
        if stream.snapshot_url is None or self._snapshot_fetcher is None:
            return stream.tracker.on_snapshot_failed()
        stream.replay_token += 1
        self._snapshot_fetcher.request((stream.ref, stream.replay_token), stream.snapshot_url)
        return []

    def _clear(self, stream: Stream, action: ClearPod) -> None:
        pod = stream.ref
        cleared = self._models[stream.model].index.clear_pod(pod)
        if self._observer is not None:
            self._observer.on_clear(pod, action.reason)
        stream.indexed_seq = None
        if action.reason == "restart":
            self._counters.add("restarts")
            stream.hash_mismatch = False  # a new engine process may run with new settings
            log.warning(
                "pod %s rank %d: engine restarted; dropped its %d entries", pod.pod_id, pod.dp_rank, cleared
            )
        elif action.reason == "resync":
            log.info(
                "pod %s rank %d: the replay ring holds the whole history again; rebuilt from it (%d entries "
                "replaced)",
                pod.pod_id,
                pod.dp_rank,
                cleared,
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

    def _apply(self, stream: Stream, seq: int, decoded: TrackedBatch, acc: _Accumulator) -> None:
        """Filter one batch's events for the index and queue them on `acc` (applied at the next flush)."""
        if not stream.owned:
            return
        acc.pending_seq[stream] = seq
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
        first_kept = len(kept)
        for pos, event in enumerate(batch.batch.events):
            if type(event) is BlocksStored:
                spec_kind = event.spec_kind
                group_idx = event.group_idx
                if (spec_kind is not None and spec_kind not in PREFIX_SPEC_KINDS) or (
                    group_idx is not None and group_idx not in prefix_groups
                ):
                    acc.non_prefix += 1
                    continue
                event_block_size = event.block_size
                if event_block_size != 0 and event_block_size != block_size:
                    self._flag_block_size(stream, seq, event, config)
                    continue
                if event.parent_key is None:
                    self._maybe_check_hashes(stream, seq, event, pos, payload, runtime)
                acc.stored += 1
            elif type(event) is BlocksRemoved:
                group_idx = event.group_idx
                if group_idx is not None and group_idx not in prefix_groups:
                    acc.non_prefix += 1
                    continue
                acc.removed += 1
            elif type(event) is AllBlocksCleared:
                acc.cleared += 1
                cleared = True
            kept.append(event)
        if cleared:
            self._flush(stream, acc)
            stream.tracker.view_complete()
            # From a sidecar, a clear may be its own (the engine restarted, or its history was lost
            # before the sidecar saw it): its snapshot says whether the sidecar's view is whole.
            stream.snapshot_check_due = stream.snapshot_url is not None
        if self._observer is not None:  # after view_complete: the observer reads the stream's flags
            self._observer.on_batch(stream.ref, seq, payload, kept[first_kept:])

    def _flush(self, stream: Stream, acc: _Accumulator) -> None:
        """One stream's gathered events into the index now (before anything that must see them)."""
        self._flush_streams([stream], acc)

    def _flush_all(self, acc: _Accumulator) -> None:
        """Every stream's gathered events at the end of a drain; then the drain's counters."""
        self._flush_streams(list(acc.pending.keys() | acc.pending_seq.keys()), acc)
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

    def _flush_streams(self, streams: list[Stream], acc: _Accumulator) -> None:
        """These streams' gathered events, one `apply_many` per model: on the in-memory index the table
        work of a whole drain runs without the GIL (with 1,000 pods a drain is ~64 pods' batches, each
        applied alone too short to be worth dropping it). A batch that fails costs only its stream."""
        by_model: dict[str, list[tuple[Stream, list[KVEvent], int | None]]] = {}
        for stream in streams:
            events = acc.pending.pop(stream, None)
            seq = acc.pending_seq.pop(stream, None)
            if not stream.owned:
                continue
            if events:
                by_model.setdefault(stream.model, []).append((stream, events, seq))
            elif seq is not None:
                stream.indexed_seq = seq
        for model, pending in by_model.items():
            try:
                outcomes = self._models[model].index.apply_many([(s.ref, events) for s, events, _ in pending])
            except Exception:
                log.exception("ingest worker failed to apply a drain of model %s", model)
                continue
            for (stream, events, seq), outcome in zip(pending, outcomes, strict=True):
                if isinstance(outcome, (StoreUnavailable, LeaseLost)):
                    self._lose(stream, outcome, acc)
                    continue
                if isinstance(outcome, Exception):
                    log.error(
                        "ingest worker failed to apply a batch of pod %s", stream.ref.pod_id, exc_info=outcome
                    )
                    continue
                acc.unknown_parents += outcome.unknown_parents
                stream.events_total += len(events)
                if seq is not None:
                    stream.indexed_seq = seq
        for stream in streams:
            stream.joined = stream.tracker.joined

    def _flag_block_size(self, stream: Stream, seq: int, event: BlocksStored, config: ModelConfig) -> None:
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
        self, stream: Stream, seq: int, event: BlocksStored, pos: int, payload: bytes, runtime: ModelRuntime
    ) -> None:
        """Sample, then read that one event's token ids again (the hot path skipped them)."""
        config = runtime.config
        if not could_be_checkable(event, config.block_size) or not self._sampler.should_check(stream.ref):
            return
        # NOTE: only the sampled event's ids are read: with 1,000 pods, decoding whole batches with their
        # token ids was a quarter of ingest's time (and splitting them into raw events ~4%).
        token_ids = stored_token_ids(payload, pos, event.block_keys)
        if token_ids is None or not is_checkable(event, config.block_size, token_ids):
            return  # the batch read differently, or skipped (null) blocks
        stream.hash_checks_total += 1
        if keys_agree(event.block_keys, token_ids, runtime.hasher):
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
                diagnose_mismatch(msgspec.structs.replace(event, token_ids=tuple(token_ids)), config),
            )
