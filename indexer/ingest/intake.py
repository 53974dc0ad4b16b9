"""Write path, stage 2: the subscriber poller's callbacks. Frames -> (topic checks) -> the pod's ordered
queue. Nothing is decoded here: the one poller thread reads every socket, so it only routes."""

from __future__ import annotations

import time
from collections.abc import Collection

from kvindex.indexer.ingest.counters import Counters
from kvindex.indexer.ingest.pod_queues import PodQueues
from kvindex.indexer.ingest.settings import IngestSettings
from kvindex.indexer.ingest.streams import ControlItem, LiveItem, StreamTable, WorkItem
from kvindex.replay.frames import FrameError, parse_live
from kvindex.replay.subscriber import LinkEvent

TOPIC_PREFIX = "kv"


def parse_topic(topic: bytes) -> tuple[str, str] | None:
    """(pod id, model) of a bind-mode topic `kv@<pod>@<model>` (the model may contain `@`), or None."""
    try:
        # Strict: two byte strings must never become one pod id through replacement characters.
        parts = topic.decode("utf-8").split("@", 2)
    except UnicodeDecodeError:
        return None
    if len(parts) != 3 or parts[0] != TOPIC_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


class Intake:
    """Routes what the poller reads: live messages to their pod's worker, link changes to stream flags
    and reconnect checks. Runs on the poller thread only (the one thread allowed to wait for room)."""

    def __init__(
        self,
        settings: IngestSettings,
        streams: StreamTable,
        model_names: Collection[str],
        queues: PodQueues[WorkItem],
        counters: Counters,
    ) -> None:
        self._settings = settings
        self._streams = streams
        self._model_names = frozenset(model_names)
        self._queues = queues
        self._counters = counters
        # Engines connected to the bound SUBs right now (bind mode's only link state).
        self.listen_peers = 0

    def on_frames(self, source_id: str, frames: list[bytes]) -> None:
        stream = self._streams.by_source.get(source_id)
        if stream is not None and len(frames) == 3 and len(frames[1]) == 8:
            # Connect mode, well-formed (what parse_live would accept): no intermediate message object.
            seq = int.from_bytes(frames[1], "big")
            self.submit(
                stream.ref.pod_id, LiveItem(source_id, stream.model, seq, frames[2]), from_poller=True
            )
            return
        try:
            message = parse_live(frames)
        except FrameError as exc:
            self._counters.drop(exc.reason, f"{source_id}: {exc.detail}")
            return
        if stream is not None:
            live = LiveItem(source_id, stream.model, message.seq, message.payload)
            self.submit(stream.ref.pod_id, live, from_poller=True)
            return
        parsed = parse_topic(message.topic)
        if parsed is None:
            self._counters.drop(
                "bad_topic", f"topic {message.topic!r} is not kv@<pod>@<model> (seq {message.seq})"
            )
            return
        pod_id, model = parsed
        if model not in self._model_names:
            self._counters.drop(
                "unknown_model", f"pod {pod_id} publishes model {model!r}, which is not configured"
            )
            return
        self.submit(pod_id, LiveItem(source_id, model, message.seq, message.payload), from_poller=True)

    def on_link(self, source_id: str, event: LinkEvent) -> None:
        stream = self._streams.by_source.get(source_id)
        if stream is not None:
            if stream.connected and event != "connected":
                stream.disconnected_at = time.monotonic()
            stream.connected = event == "connected"
            if event == "connected":
                # Every connection, the first included: the engine may have published before we were
                # subscribed (a fresh engine bursts at once) or be a new process on the same address.
                stream.ever_connected = True
                stream.forgotten = False
                stream.connected_at = time.monotonic()
                self.submit(stream.ref.pod_id, ControlItem("reconnect", stream.ref), force=True)
            return
        # Bind mode: ZMQ does not say which engine came or went, and a fresh engine's first burst may
        # reach nobody (its PUB drops until our subscription arrives). So every stream stops trusting
        # unexplained seqs and is probed once it has been quiet for quiet_probe_after_s after this
        # connection: connections that come closer together than that share one probe per stream.
        if event == "connected":
            self.listen_peers += 1
            now = time.monotonic()
            for bound in self._streams.bound():
                bound.forgotten = False
                bound.connected_at = now
                # Through the pod's queue: the tracker is the worker's alone, and it takes the mark in
                # order with the stream's messages.
                self.submit(bound.ref.pod_id, ControlItem("unverified", bound.ref), force=True)
        else:
            self.listen_peers = max(0, self.listen_peers - 1)
            if self.listen_peers == 0:
                now = time.monotonic()
                for bound in self._streams.bound():
                    bound.disconnected_at = now

    def submit(self, pod_id: str, item: WorkItem, *, from_poller: bool = False, force: bool = False) -> None:
        """Queue for the pod's worker. Only the poller thread may wait for room (PodQueues allows one
        waiting submitter); `force` (control items a stream needs) queues past the bound."""
        wait_s = self._settings.queue_full_wait_s if from_poller else 0.0
        if not self._queues.submit(pod_id, item, wait_s=wait_s, force=force):
            # The stream sees a gap at its next message (or the quiet probe) and replays it.
            seq = item.seq if isinstance(item, LiveItem) else None
            self._counters.drop("queue_full", f"pod {pod_id}: worker queue full, message seq {seq} dropped")
