"""Stage 3 of the write path: per-pod ordered work queues between the subscriber poller and the index.

A pod always maps to the same worker thread (FNV-1a 32-bit of its id, modulo the worker count), so one
pod's batches are handled strictly in arrival order while different pods proceed in parallel. Queues are
bounded: `submit` never blocks the poller; a full queue drops the item and says so.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")

log = logging.getLogger(__name__)

FNV32_OFFSET_BASIS = 0x811C9DC5
FNV32_PRIME = 0x01000193

_STOP = object()


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32-bit: stable across processes and runs (Python's hash() of str is not)."""
    value = FNV32_OFFSET_BASIS
    for byte in data:
        value = ((value ^ byte) * FNV32_PRIME) & 0xFFFFFFFF
    return value


def worker_for(pod_id: str, num_workers: int) -> int:
    return fnv1a_32(pod_id.encode("utf-8")) % num_workers


class PodQueues(Generic[T]):
    """`num_workers` threads, each draining its own bounded FIFO with `handle(pod_id, item)`.

    Contract: items of one pod are handled one at a time, in submission order, by one thread. A slow
    `handle` (e.g. a replay, bounded by its own timeout) delays every pod sharing that worker. An
    exception from `handle` is logged and the worker goes on with the next item.
    """

    def __init__(
        self,
        handle: Callable[[str, T], None],
        *,
        num_workers: int = 4,
        queue_size: int = 10_000,
        name: str = "kvindex-ingest",
    ) -> None:
        if num_workers < 1 or queue_size < 1:
            raise ValueError("num_workers and queue_size must be at least 1")
        self._handle = handle
        self._name = name
        self._queues: list[queue.Queue[tuple[str, T] | object]] = [
            queue.Queue(maxsize=queue_size) for _ in range(num_workers)
        ]
        self._threads: list[threading.Thread] = []
        self._started = False

    @property
    def num_workers(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for idx, work in enumerate(self._queues):
            thread = threading.Thread(target=self._run, args=(work,), name=f"{self._name}-{idx}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, pod_id: str, item: T) -> bool:
        """Queue an item for the pod's worker; False (item dropped) when that worker's queue is full."""
        try:
            self._queues[worker_for(pod_id, len(self._queues))].put_nowait((pod_id, item))
        except queue.Full:
            return False
        return True

    def depth(self) -> int:
        return sum(work.qsize() for work in self._queues)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Finish what is queued, then stop the workers; False if one did not stop within the timeout."""
        if not self._started:
            return True
        for work in self._queues:
            try:
                work.put(_STOP, timeout=timeout_s)
            except queue.Full:
                log.warning("an ingest worker did not drain its queue within %.1f s at stop", timeout_s)
        stopped = True
        for thread in self._threads:
            thread.join(timeout_s)
            stopped = stopped and not thread.is_alive()
        self._threads = []
        return stopped

    def _run(self, work: queue.Queue[tuple[str, T] | object]) -> None:
        while True:
            entry = work.get()
            if entry is _STOP:
                return
            pod_id, item = cast(tuple[str, T], entry)
            try:
                self._handle(pod_id, item)
            except Exception:
                log.exception("ingest worker failed on an item of pod %s", pod_id)
