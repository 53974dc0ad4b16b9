"""Per-pod ordered queues: xxHash32 sharding (published test values) and per-pod order under load."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import xxhash
from kvindex.indexer.ingest.pod_queues import PodQueues, worker_for
from waiting import wait_for


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # XXH32 with seed 0, from xxHash's own sanity checks (the spec's empty-input value and two more).
        (b"", 0x02CC5D05),
        (b"a", 0x550D7456),
        (b"abc", 0x32D153FF),
    ],
)
def test_pods_are_sharded_by_xxh32_published_values(data: bytes, expected: int) -> None:
    assert xxhash.xxh32_intdigest(data) == expected
    assert worker_for(data.decode(), 7) == expected % 7


def one_at_a_time(handle: Callable[[str, int], None]) -> Callable[[list[tuple[str, int]]], None]:
    """A handle_many that handles its entries one by one (with max_batch=1: one item per call)."""

    def handle_many(entries: list[tuple[str, int]]) -> None:
        for pod_id, item in entries:
            handle(pod_id, item)

    return handle_many


def test_a_pod_always_maps_to_one_worker_and_pods_spread() -> None:
    workers = {worker_for(f"pod-{i}", 4) for i in range(100)}
    assert workers == {0, 1, 2, 3}


def test_each_pods_items_are_handled_in_order_by_one_thread() -> None:
    seen: dict[str, list[int]] = {}
    threads: dict[str, set[str]] = {}
    lock = threading.Lock()

    def handle(pod_id: str, item: int) -> None:
        with lock:
            seen.setdefault(pod_id, []).append(item)
            threads.setdefault(pod_id, set()).add(threading.current_thread().name)

    queues: PodQueues[int] = PodQueues(one_at_a_time(handle), num_workers=3, queue_size=100_000)
    queues.start()
    pods = [f"pod-{i}" for i in range(10)]
    for n in range(500):
        for pod in pods:
            assert queues.submit(pod, n)
    wait_for(lambda: sum(len(v) for v in seen.values()) == 5000)
    assert queues.stop()
    assert all(seen[pod] == list(range(500)) for pod in pods)
    assert all(len(names) == 1 for names in threads.values())


def test_full_queue_drops_and_reports_it_and_a_blocked_pod_does_not_stall_other_workers() -> None:
    release = threading.Event()
    handled: list[tuple[str, int]] = []
    blocked_pod = "foobar"
    other_pod = next(f"p{i}" for i in range(100) if worker_for(f"p{i}", 2) != worker_for(blocked_pod, 2))

    def handle(pod_id: str, item: int) -> None:
        if pod_id == blocked_pod:
            assert release.wait(10)
        handled.append((pod_id, item))

    queues: PodQueues[int] = PodQueues(one_at_a_time(handle), num_workers=2, queue_size=2, max_batch=1)
    queues.start()
    assert queues.submit(blocked_pod, 0)
    wait_for(lambda: queues.depth() == 0)  # the worker holds item 0
    assert queues.submit(blocked_pod, 1) and queues.submit(blocked_pod, 2)
    assert not queues.submit(blocked_pod, 3)  # bounded: dropped, and the caller is told
    assert queues.submit(other_pod, 7)
    wait_for(lambda: (other_pod, 7) in handled)
    release.set()
    wait_for(lambda: len(handled) == 4)
    assert [i for p, i in handled if p == blocked_pod] == [0, 1, 2]
    assert queues.stop()


def test_a_full_queue_holds_a_waiting_submitter_until_the_worker_makes_room() -> None:
    release = threading.Event()
    handled: list[int] = []

    def handle(pod_id: str, item: int) -> None:
        assert release.wait(10)
        handled.append(item)

    queues: PodQueues[int] = PodQueues(one_at_a_time(handle), num_workers=1, queue_size=2, max_batch=1)
    queues.start()
    assert queues.submit("a", 0)
    wait_for(lambda: queues.depth() == 0)  # the worker holds item 0
    assert queues.submit("a", 1) and queues.submit("a", 2)
    assert not queues.submit("a", 3, wait_s=0.05)  # nobody makes room in time: dropped, and said so

    def release_once_the_submitter_waits() -> None:
        wait_for(lambda: queues._waiting[0])
        release.set()

    releaser = threading.Thread(target=release_once_the_submitter_waits)
    releaser.start()
    assert queues.submit("a", 4, wait_s=10)  # back-pressure: waits for room instead of dropping
    releaser.join()
    wait_for(lambda: len(handled) == 4)
    assert handled == [0, 1, 2, 4]
    assert queues.stop()


def test_a_failing_handler_does_not_kill_the_worker() -> None:
    handled: list[int] = []

    def handle(pod_id: str, item: int) -> None:
        if item == 0:
            raise RuntimeError("bad item")
        handled.append(item)

    queues: PodQueues[int] = PodQueues(one_at_a_time(handle), num_workers=1, max_batch=1)
    queues.start()
    queues.submit("a", 0)
    queues.submit("a", 1)
    wait_for(lambda: handled == [1])
    assert queues.stop()
    assert queues.stop()  # idempotent
