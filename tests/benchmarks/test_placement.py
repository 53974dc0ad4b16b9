"""benchmarks/placement.py: where each server answered, read from /proc, and the idle timing split by it
(real `kvindex serve`, publisher and floor processes on 127.0.0.1)."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.compare import FLOOR
from benchmarks.placement import measure, placement_class, thread_cpu
from benchmarks.workload import WorkloadSpec

pytestmark = pytest.mark.timeout(180)


def test_thread_cpu_names_the_cpu_the_kernel_ran_the_thread_on() -> None:
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})  # the kernel moves this thread there before returning
            sum(range(10_000))  # run a little there
            assert thread_cpu(os.getpid(), threading.get_native_id()) == cpu
    finally:
        os.sched_setaffinity(0, allowed)


def test_placement_classes() -> None:
    assert placement_class(1, None, 0) == "first request"
    assert placement_class(1, 1, 1) == "same CPU as before, on the client's"
    assert placement_class(1, 1, 0) == "same CPU as before, off the client's"
    assert placement_class(0, 1, 0) == "moved CPU, on the client's"
    assert placement_class(0, 1, 1) == "moved CPU, off the client's"


def test_every_timed_request_of_kvindex_and_the_floor_is_filed_once() -> None:
    spec = WorkloadSpec(num_engines=3, blocks_per_engine=64, num_prefixes=2, num_queries=6)
    observer = measure(spec, passes=2, with_dynamo=False)
    for name in ("kvindex", FLOOR):
        for kind in ("tokens", "hashes", "tokens_full"):
            filed = [
                samples
                for (service, asked, _), samples in observer.by_placement.items()
                if (service, asked) == (name, kind)
            ]
            assert sum(map(len, filed)) == 2 * 6
            assert all(seconds > 0 for samples in filed for seconds in samples)
