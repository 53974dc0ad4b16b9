"""Concurrent replay requests: one thread multiplexes a DEALER per outstanding request, so a slow or dead
replay socket delays only its own stream (never another pod's ingest) and a thousand pods join at once.

Same protocol as `replay_client.replay_from` (vLLM's ROUTER: `[b"", start_seq]` -> replies, end marker).
A request may be delayed (`delay_s`: the caller's backoff); each gets a fresh DEALER, so replies to a
timed-out request are never read as the answer to a later one. Results go to `on_result(key, result)`
on this thread: it must not block (hand the result to a queue).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

import msgspec
import zmq
from kvindex.replay.frames import FrameError, ReplayMessage, parse_replay, replay_request_frames
from kvindex.replay.replay_client import ReplayResult

log = logging.getLogger(__name__)

_WAKE_POLL_MS = 1_000  # the longest the thread sleeps without news (a stop or a request wakes it)


class _Request(msgspec.Struct):
    key: Hashable
    endpoint: str
    start_seq: int
    messages: list[ReplayMessage] = []
    bad_frames: dict[str, int] = {}
    deadline: float = 0.0


class ReplayFetcher:
    """Runs replay requests concurrently on one thread (at most `max_in_flight` sockets open at once).

    `timeout_s` is an idle timeout: a request fails when no reply arrived for that long (a large ring
    streamed at any pace completes). A failed request reports `complete=False`; connection errors
    (a malformed endpoint) too, with `error` set.
    """

    def __init__(
        self,
        on_result: Callable[[Hashable, ReplayResult], None],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]],
        timeout_s: float = 2.0,
        max_in_flight: int = 256,
        name: str = "kvindex-replay",
    ) -> None:
        self._on_result = on_result
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._max_in_flight = max_in_flight
        self._name = name
        self._incoming: deque[tuple[float, _Request]] = deque()
        self._delayed: list[tuple[float, int, _Request]] = []
        self._waiting: deque[_Request] = deque()
        self._order = itertools.count()
        self._wake_endpoint = f"inproc://kvindex-replay-wake-{id(self)}"
        self._wake_send: zmq.Socket[bytes] | None = None
        self._wake_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False

    def start(self) -> None:
        if self._thread is not None:
            return
        wake_recv: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
        wake_recv.setsockopt(zmq.LINGER, 0)
        wake_recv.bind(self._wake_endpoint)
        sender: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        sender.setsockopt(zmq.LINGER, 0)
        sender.setsockopt(zmq.SNDHWM, 1)
        sender.connect(self._wake_endpoint)
        self._wake_send = sender
        self._running = True
        self._thread = threading.Thread(target=self._run, args=(wake_recv,), name=self._name, daemon=True)
        self._thread.start()

    def request(self, key: Hashable, endpoint: str, start_seq: int, *, delay_s: float = 0.0) -> None:
        """Ask `endpoint` for every batch with seq >= start_seq, after `delay_s`; thread-safe."""
        self._incoming.append((time.monotonic() + delay_s, _Request(key, endpoint, start_seq)))
        self._wake()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Abandon outstanding requests and stop; False if the thread did not stop in time."""
        self._running = False
        self._wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
        with self._wake_lock:
            if self._wake_send is not None:
                self._wake_send.close(linger=0)
                self._wake_send = None
        return True

    def _wake(self) -> None:
        with self._wake_lock:
            sender = self._wake_send
            if sender is None:
                return
            try:
                sender.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    def _run(self, wake_recv: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(wake_recv, zmq.POLLIN)
        open_requests: dict[zmq.Socket[bytes], _Request] = {}
        try:
            while self._running:
                now = time.monotonic()
                self._take_incoming(now)
                while self._delayed and self._delayed[0][0] <= now:
                    self._waiting.append(heapq.heappop(self._delayed)[2])
                while self._waiting and len(open_requests) < self._max_in_flight:
                    self._open(self._waiting.popleft(), poller, open_requests, now)
                timeout_ms = self._next_timeout_ms(open_requests, now)
                for sock, _ in poller.poll(timeout_ms):
                    if sock is wake_recv:
                        while True:
                            try:
                                wake_recv.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                        continue
                    request = open_requests.get(sock)
                    if request is not None:
                        self._read(sock, request, poller, open_requests)
                now = time.monotonic()
                for sock, request in list(open_requests.items()):
                    if request.deadline <= now:
                        self._finish(sock, request, False, poller, open_requests)
        except Exception:
            log.exception("replay fetcher stopped on an unexpected error")
        finally:
            for sock in open_requests:
                sock.close(linger=0)
            wake_recv.close(linger=0)

    def _take_incoming(self, now: float) -> None:
        while self._incoming:
            due, request = self._incoming.popleft()
            if due <= now:
                self._waiting.append(request)
            else:
                heapq.heappush(self._delayed, (due, next(self._order), request))

    def _next_timeout_ms(self, open_requests: dict[zmq.Socket[bytes], _Request], now: float) -> int:
        due = [request.deadline for request in open_requests.values()]
        if self._delayed:
            due.append(self._delayed[0][0])
        if not due:
            return _WAKE_POLL_MS
        return max(0, min(_WAKE_POLL_MS, int((min(due) - now) * 1000) + 1))

    def _open(
        self,
        request: _Request,
        poller: zmq.Poller,
        open_requests: dict[zmq.Socket[bytes], _Request],
        now: float,
    ) -> None:
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(request.endpoint)
            dealer.send_multipart(replay_request_frames(request.start_seq), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            log.warning("replay request to %s failed: %s", request.endpoint, exc)
            self._report(
                request, ReplayResult(messages=[], complete=False, history_lost=False, error=str(exc))
            )
            return
        request.deadline = now + self._timeout_s
        poller.register(dealer, zmq.POLLIN)
        open_requests[dealer] = request

    def _read(
        self,
        sock: zmq.Socket[bytes],
        request: _Request,
        poller: zmq.Poller,
        open_requests: dict[zmq.Socket[bytes], _Request],
    ) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                request.deadline = time.monotonic() + self._timeout_s
                return
            try:
                message = parse_replay(frames)
            except FrameError as exc:
                request.bad_frames[exc.reason] = request.bad_frames.get(exc.reason, 0) + 1
                continue
            if message.is_end:
                self._finish(sock, request, True, poller, open_requests)
                return
            request.messages.append(message)

    def _finish(
        self,
        sock: zmq.Socket[bytes],
        request: _Request,
        complete: bool,
        poller: zmq.Poller,
        open_requests: dict[zmq.Socket[bytes], _Request],
    ) -> None:
        poller.unregister(sock)
        del open_requests[sock]
        sock.close(linger=0)
        messages = request.messages
        history_lost = bool(messages) and messages[0].seq > request.start_seq
        self._report(
            request,
            ReplayResult(
                messages=messages, complete=complete, history_lost=history_lost, bad_frames=request.bad_frames
            ),
        )

    def _report(self, request: _Request, result: ReplayResult) -> None:
        try:
            self._on_result(request.key, result)
        except Exception:
            log.exception("replay result handler failed for %r", request.key)
