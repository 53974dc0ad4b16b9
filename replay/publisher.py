"""A vLLM-compatible KV-event publisher: PUB for live batches + ROUTER replaying the last N batches.

Byte-identical to vLLM 0.33's ZmqEventPublisher on the wire (same frames, same payload bytes, same
replay replies), used by the engine simulator and the sidecar. One difference on purpose: `publish`
never blocks its caller indefinitely (vLLM's blocks the scheduler when its queue is full); a batch that
cannot be queued within `publish_timeout_s` is dropped and counted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

import msgspec
import zmq
from kvindex.replay.endpoints import has_ephemeral_port, offset_endpoint_port, should_bind
from kvindex.replay.frames import (
    FrameError,
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)
from kvindex.replay.wire import KVEventBatch, WireEvent

logger = logging.getLogger(__name__)

# vLLM encodes with a default msgspec Encoder; the same settings give the same bytes.
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM sends for `batch` (byte for byte)."""
    return _ENCODER.encode(batch)


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the endpoint a peer can dial (ephemeral tcp ports resolved)."""
    sock.bind(endpoint)
    if not has_ephemeral_port(endpoint):
        return endpoint
    last_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last_endpoint, bytes)
    return last_endpoint.decode()


class EventPublisher:
    """Publishes batches with seq 0, 1, 2, ... ; keeps the last `buffer_steps` for replay.

    `publish` never blocks its caller indefinitely. `endpoint` / `replay_endpoint` are the effective
    addresses (after the DP offset and after resolving an ephemeral port `tcp://host:0`).

    Sockets are created (and bound/connected) in the constructor, so address errors surface there; after
    that only the background thread touches them. A tcp endpoint with port 0 or `*` is always bound,
    since there is nothing to connect to. `bind` overrides vLLM's rule (None: the rule decides), for a
    publisher that must bind a fixed loopback address such as one taking over a restarted engine's.
    """

    endpoint: str
    replay_endpoint: str | None

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        bind: bool | None = None,
        dp_rank: int = 0,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        publish_timeout_s: float = 1.0,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        self.dp_rank = dp_rank
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.replay_hwm = 2 * (buffer_steps + 1)
        self.publish_timeout_s = publish_timeout_s
        self._topic_bytes = topic.encode("utf-8")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = ctx if ctx is not None else zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # A batch to encode, or a payload already encoded (`publish_payload`: sent as it is).
        self._queue: queue.Queue[KVEventBatch | bytes] = queue.Queue(maxsize=max_queue_size)

        effective_endpoint = offset_endpoint_port(endpoint, dp_rank)
        effective_replay = offset_endpoint_port(replay_endpoint, dp_rank)
        assert effective_endpoint is not None
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            if (
                bind
                if bind is not None
                else should_bind(effective_endpoint) or has_ephemeral_port(effective_endpoint)
            ):
                self.endpoint = _bind(self._pub, effective_endpoint)
            else:
                self._pub.connect(effective_endpoint)
                self.endpoint = effective_endpoint
            self.replay_endpoint = None
            if effective_replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole replay plus its end marker must fit even though ZMQ acks reads lazily.
                self._replay.setsockopt(zmq.SNDHWM, self.replay_hwm)
                self.replay_endpoint = _bind(self._replay, effective_replay)
        except BaseException:
            self._close_sockets()
            raise

        self.sent_count = 0
        self.dropped_count = 0
        self.replay_requests_count = 0
        self.bad_replay_requests_count = 0
        self.last_seq: int | None = None
        self._next_seq = 0
        self._num_enqueued = 0
        self._num_handled = 0
        self._progress = threading.Condition()
        self._running = True
        self._closed = False
        # The thread sleeps in zmq.Poller on the replay socket and this pipe; publish() writes a byte.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # --- caller side ----------------------------------------------------------------------------

    def publish(
        self, events: Sequence[WireEvent], *, ts: float | None = None, data_parallel_rank: int | None = None
    ) -> bool:
        """Queue one batch (one engine step). `ts` defaults to now; the rank defaults to ours.

        Returns False (and counts a drop) when the queue stayed full for `publish_timeout_s`.
        """
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=data_parallel_rank,
        )
        return self.publish_batch(batch)

    def publish_batch(self, batch: KVEventBatch) -> bool:
        """Queue a ready-made batch; like vLLM, its rank is filled in only when it is None."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self.dp_rank)
        return self._enqueue(batch)

    def publish_payload(self, payload: bytes) -> bool:
        """Queue a batch payload encoded elsewhere (a relay forwarding another publisher's batch): sent
        byte for byte under this publisher's next seq, rank and all as they are in the bytes."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        return self._enqueue(payload)

    def _enqueue(self, batch: KVEventBatch | bytes) -> bool:
        with self._progress:
            self._num_enqueued += 1
        try:
            self._queue.put(batch, timeout=self.publish_timeout_s)
        except queue.Full:
            with self._progress:
                self.dropped_count += 1
                self._num_handled += 1
                self._progress.notify_all()
            return False
        self._wake()
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued has been sent; False on timeout."""
        with self._progress:
            return (
                self._progress.wait_for(
                    lambda: self._num_handled >= self._num_enqueued or not self._thread.is_alive(),
                    timeout=timeout_s,
                )
                and self._num_handled >= self._num_enqueued
            )

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), stop the thread, close sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._running = False
        self._wake()
        self._thread.join(timeout=max(timeout_s, 1.0))
        if not self._thread.is_alive():
            self._close_sockets()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full: a wake-up is already pending; closed: the thread is gone

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # --- background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running:
            ready = dict(poller.poll(timeout=1000))
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            # Live batches first: replay is the non-critical path (same priority as vLLM).
            self._drain_queue()
            if self._replay is not None and self._replay in ready:
                self._service_replay()
        self._drain_queue()

    def _drain_queue(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(batch)

    def _send(self, batch: KVEventBatch | bytes) -> None:
        # Like vLLM, a seq is consumed even if sending fails, which leaves a gap for consumers to see.
        seq = self._next_seq
        self._next_seq += 1
        sent = False
        try:
            payload = batch if isinstance(batch, bytes) else encode_batch(batch)
            self._pub.send_multipart(live_frames(self._topic_bytes, seq, payload))
            self._buffer.append((seq, payload))
            sent = True
        except (zmq.ZMQError, msgspec.EncodeError, TypeError, ValueError):
            logger.exception("publishing batch seq=%d failed", seq)
        with self._progress:
            if sent:
                self.sent_count += 1
                self.last_seq = seq
            else:
                self.dropped_count += 1
            self._num_handled += 1
            self._progress.notify_all()

    def _service_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start_seq = parse_replay_request(frames)
            except FrameError as exc:
                self.bad_replay_requests_count += 1
                logger.warning("ignoring invalid replay request (%s)", exc)
                continue
            self.replay_requests_count += 1
            try:
                for seq, payload in self._buffer:
                    if seq >= start_seq:
                        self._replay.send_multipart(
                            replay_reply_frames(identity, self._topic_bytes, seq, payload)
                        )
                self._replay.send_multipart(replay_end_frames(identity))
            except zmq.ZMQError:
                logger.exception("replay to a client failed")
