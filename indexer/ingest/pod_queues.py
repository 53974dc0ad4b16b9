"""Stage 3 of the write path: per-pod ordered work queues between the subscriber poller and the index.

A pod always maps to the same worker thread (xxHash32 of its id, modulo the worker count), so one
pod's batches are handled strictly in arrival order while different pods proceed in parallel. Queues are
bounded: a full queue makes `submit` wait a bounded time for room (back-pressure: meanwhile messages wait
in ZMQ's own buffers instead of being dropped here), then drops the item and says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

T = TypeVar("T")

log = logging.getLogger(__name__)


def worker_for(pod_id: str, num_workers: int) -> int:
    """The worker of a pod: stable across processes and runs (Python's hash() of str is not), in C."""
    return xxhash.xxh32_intdigest(pod_id.encode("utf-8")) % num_workers


class PodQueues(Generic[T]):
    """`num_workers` threads, each draining its own bounded FIFO.

    Contract: items of one pod are handled one at a time, in submission order, by one thread. A slow
    handler (e.g. a replay, bounded by its own timeout) delays every pod sharing that worker.
    A worker takes everything queued (up to `max_batch` (pod_id, item) entries, in order) per
    `handle_many(entries)` call — cheaper per item, and lets the handler apply several messages of a pod
    at once; an exception escaping it is logged and that batch is lost.

    A deque + Event per worker instead of queue.Queue: one append and (only when the worker sleeps) one
    set() per item, instead of a lock and two conditions per put and get.
    """

    def __init__(
        self,
        handle_many: Callable[[list[tuple[str, T]]], None],
        *,
        num_workers: int = 4,
        queue_size: int = 10_000,
        name: str = "kvindex-ingest",
        max_batch: int = 256,
    ) -> None:
        if num_workers < 1 or queue_size < 1 or max_batch < 1:
            raise ValueError("num_workers, queue_size and max_batch must be at least 1")
        self._handle_many = handle_many
        self._name = name
        self._queue_size = queue_size
        self._max_batch = max_batch
        self._queues: list[deque[tuple[str, T]]] = [deque() for _ in range(num_workers)]
        self._wakeups = [threading.Event() for _ in range(num_workers)]
        # Set by a worker after it took items off a queue that a submitter found full.
        self._room = [threading.Event() for _ in range(num_workers)]
        self._waiting = [False] * num_workers
        # Pod id -> worker number (a dict lookup is cheaper than hashing the id again).
        self._worker_of: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopping = False

    @property
    def num_workers(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for idx in range(len(self._queues)):
            thread = threading.Thread(target=self._run, args=(idx,), name=f"{self._name}-{idx}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, pod_id: str, item: T, *, wait_s: float = 0.0, force: bool = False) -> bool:
        """Queue an item for the pod's worker.

        When that worker's queue is full, wait up to `wait_s` for room; False (item dropped) if none came.
        Only one thread (the poller) may submit with `wait_s > 0`. `force`: queue it past the bound (for
        the few control items a stream cannot do without, such as a replay's answer).
        """
        idx = self._worker_of.get(pod_id)
        if idx is None:
            idx = self._worker_of[pod_id] = worker_for(pod_id, len(self._queues))
        work = self._queues[idx]
        if len(work) >= self._queue_size and not force and not self._wait_for_room(idx, wait_s):
            return False
        work.append((pod_id, item))
        wakeup = self._wakeups[idx]
        if not wakeup.is_set():
            wakeup.set()
        return True

    def _wait_for_room(self, idx: int, wait_s: float) -> bool:
        if wait_s <= 0 or self._stopping:
            return False
        work, room = self._queues[idx], self._room[idx]
        deadline = time.monotonic() + wait_s
        self._waiting[idx] = True
        try:
            while len(work) >= self._queue_size:
                room.clear()
                if len(work) < self._queue_size:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping or not room.wait(remaining):
                    return False
            return True
        finally:
            self._waiting[idx] = False

    def depth(self) -> int:
        return sum(len(work) for work in self._queues)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Drop what is still queued, let each worker finish the batch in hand, and stop them; False if
        one did not stop within the timeout (a stopping process has no use for queued events)."""
        if not self._started:
            return True
        self._stopping = True
        for work in self._queues:
            work.clear()
        for wakeup in self._wakeups:
            wakeup.set()
        deadline = time.monotonic() + timeout_s
        stopped = True
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            stopped = stopped and not thread.is_alive()
        if not stopped:
            log.warning("an ingest worker did not drain its queue within %.1f s at stop", timeout_s)
        self._threads = []
        return stopped

    def _run(self, idx: int) -> None:
        work = self._queues[idx]
        wakeup = self._wakeups[idx]
        handle_many = self._handle_many
        max_batch = self._max_batch
        popleft = work.popleft
        room = self._room[idx]
        waiting = self._waiting
        while True:
            # Cleared before draining: an item appended after the drain sets it again (no lost wakeup).
            wakeup.clear()
            while work:
                entries = [popleft() for _ in range(min(len(work), max_batch))]
                if waiting[idx]:
                    room.set()
                try:
                    handle_many(entries)
                except Exception:
                    log.exception("ingest worker failed on a batch of %d items", len(entries))
            if self._stopping:
                return
            wakeup.wait()
