"""Stage 1 of the write path: the SUB sockets, read by one poller thread (the IO shell).

Connect mode dials an engine's bound PUB; bind mode binds one SUB that engines dial. Both are watched
continuously (their ZMQ_FDs in one epoll set), because a bound SUB only attaches a peer (and sends its
subscription) when the application lets it process its commands, as every read does; unread, every
message is dropped at the PUB. Raw frames are handed on untouched;
decoding happens on the per-pod workers. Connection changes come from ZMQ socket monitors.
"""

from __future__ import annotations

import logging
import selectors
import threading
from collections.abc import Callable
from typing import Literal

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

LinkEvent = Literal["connected", "disconnected"]
# Messages read from one socket before the poller looks at the others (fairness between sockets).
MAX_BATCH_PER_SOCKET = 256
POLL_INTERVAL_MS = 100

_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_MONITOR_STOPPED
)


class Subscriber:
    """One thread polling every SUB socket; `on_frames(source_id, frames)` runs on that thread.

    `on_frames` and `on_link` must not block (they hand work to queues). Sources are added before
    `start`. Reconnects use ZMQ's own capped backoff (RECONNECT_IVL doubling up to RECONNECT_IVL_MAX).
    `on_link(source_id, "connected" | "disconnected")`: in connect mode per engine; in bind mode
    "connected" for every accepted peer and "disconnected" for every lost one (ZMQ does not say which).
    """

    def __init__(
        self,
        on_frames: Callable[[str, list[bytes]], None],
        on_link: Callable[[str, LinkEvent], None],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]],
        rcvhwm: int = 100_000,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 5_000,
        max_message_bytes: int = -1,
    ) -> None:
        self._on_frames = on_frames
        self._on_link = on_link
        self._ctx = ctx
        self._rcvhwm = rcvhwm
        self._reconnect_ivl_ms = reconnect_ivl_ms
        self._reconnect_ivl_max_ms = reconnect_ivl_max_ms
        # ZMQ drops a peer that sends a larger message (before it is read into memory); -1: no limit.
        self._max_message_bytes = max_message_bytes
        self._sockets: dict[zmq.Socket[bytes], str] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._running = False
        self._thread: threading.Thread | None = None
        self.num_messages = 0

    def add_connect(self, source_id: str, endpoint: str) -> None:
        """A SUB dialling `endpoint` (an engine whose PUB binds)."""
        sock = self._new_sub(source_id)
        sock.connect(endpoint)

    def add_bind(self, source_id: str, endpoint: str) -> str:
        """A SUB bound on `endpoint` for engines that dial in; returns the resolved address."""
        sock = self._new_sub(source_id)
        sock.bind(endpoint)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvindex-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop polling and close every socket (from the poller thread); False if it did not stop."""
        self._running = False
        thread = self._thread
        if thread is None:
            self._close_all()
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _new_sub(self, source_id: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect_ivl_max_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        # Everything: topics are checked by the ingest service, which counts what it cannot place.
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_MONITOR_EVENTS)
        self._sockets[sock] = source_id
        self._monitors[monitor] = source_id
        return sock

    def _run(self) -> None:
        # The sockets' ZMQ_FDs in one epoll set, not zmq_poll: zmq_poll looks at every socket on every call
        # (with 1,000 engines, 2,000 sockets: milliseconds of CPU each wake, idle or not, which stalled the
        # score path beside it on a 2-core box); epoll wakes for the sockets that changed.
        selector = selectors.DefaultSelector()
        try:
            for monitor, source_id in self._monitors.items():
                selector.register(monitor, selectors.EVENT_READ, (True, monitor, source_id))
            for sock, source_id in self._sockets.items():  # a zmq socket's fileno() is its ZMQ_FD
                selector.register(sock, selectors.EVENT_READ, (False, sock, source_id))
            # A ZMQ_FD signals that something changed, not that messages wait: once a socket has been
            # read until EAGAIN it signals again for the next message, but one that may still hold some
            # (registered with a backlog, or left at MAX_BATCH_PER_SOCKET) stays due until a read drains it.
            due_monitors = dict(self._monitors)
            due_sockets = dict(self._sockets)
            while self._running:
                ready = selector.select(0 if due_monitors or due_sockets else POLL_INTERVAL_MS / 1000)
                for key, _ in ready:
                    is_monitor, sock, source_id = key.data
                    (due_monitors if is_monitor else due_sockets)[sock] = source_id
                # Link events first: a reconnect must be known before the new connection's messages.
                if due_monitors:
                    for monitor, source_id in due_monitors.items():
                        self._read_monitor(monitor, source_id)
                    due_monitors.clear()
                if due_sockets:
                    drained = [
                        sock
                        for sock, source_id in due_sockets.items()
                        if self._read_messages(sock, source_id)
                    ]
                    for sock in drained:
                        del due_sockets[sock]
        except Exception:
            log.exception("subscriber poller stopped on an unexpected error")
        finally:
            selector.close()
            self._close_all()

    def _read_messages(self, sock: zmq.Socket[bytes], source_id: str) -> bool:
        """Up to MAX_BATCH_PER_SOCKET messages (fairness between sockets); True once it found no more."""
        on_frames = self._on_frames
        recv = sock.recv
        for _ in range(MAX_BATCH_PER_SOCKET):
            # recv_multipart asks getsockopt(RCVMORE) after every frame, building an Enum each time; a
            # Frame says `more` itself (30% less per 3-frame message, min of 7 x 30,000).
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            frames = [frame.bytes]
            while frame.more:  # the rest of a multipart message arrives with its first frame
                frame = recv(zmq.NOBLOCK, copy=False)
                frames.append(frame.bytes)
            self.num_messages += 1
            try:
                on_frames(source_id, frames)
            except Exception:
                log.exception("dropping a message from %s: its handler failed", source_id)
        return False

    def _read_monitor(self, monitor: zmq.Socket[bytes], source_id: str) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._on_link(source_id, "connected")
            elif kind == zmq.EVENT_DISCONNECTED:
                log.info("%s: peer disconnected (%s)", source_id, event.get("endpoint"))
                self._on_link(source_id, "disconnected")

    def _close_all(self) -> None:
        for sock in list(self._sockets):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._sockets.clear()
        self._monitors.clear()
