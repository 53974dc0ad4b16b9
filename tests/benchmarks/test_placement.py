"""benchmarks/placement.py: where each server answered, read from /proc, and the idle timing split by it
(real `kvindex serve`, publisher and floor processes on 127.0.0.1)."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.compare import FLOOR
from benchmarks.placement import (
    C_FLOOR,
    PlacementObserver,
    against_baseline,
    measure,
    placement_class,
    thread_cpu,
)
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


def _p99(samples: list[float]) -> float:
    # the nearest-rank p99 of 100 or fewer samples is their largest
    assert len(samples) <= 100
    return max(samples)


def test_every_timed_request_of_kvindex_and_the_floor_is_filed_once() -> None:
    spec = WorkloadSpec(num_engines=3, blocks_per_engine=64, num_prefixes=2, num_queries=6)
    observer = measure(spec, passes=2, with_dynamo=False, c_floor=True)
    for name in ("kvindex", FLOOR, C_FLOOR):
        for kind in ("tokens", "hashes", "tokens_full"):
            filed = [
                samples
                for (service, asked, _), samples in observer.by_placement.items()
                if (service, asked) == (name, kind)
            ]
            assert sum(map(len, filed)) == 2 * 6
            assert all(seconds > 0 for samples in filed for seconds in samples)
            every = observer.every[(name, kind)].samples_s
            assert sorted(every) == sorted(seconds for samples in filed for seconds in samples)
    rows = against_baseline(observer, FLOOR)
    for kind in ("tokens", "hashes", "tokens_full"):
        whole = [row for row in rows if row[:3] == ["kvindex", kind, "every answer"]]
        kvindex_p99 = _p99(observer.every[("kvindex", kind)].samples_s)
        floor_p99 = _p99(observer.every[(FLOOR, kind)].samples_s)
        assert (
            whole
            == [
                [
                    "kvindex",
                    kind,
                    "every answer",
                    12,
                    "100%",
                    f"{sorted(observer.every[('kvindex', kind)].samples_s)[6] * 1e3:.3f}",  # nearest-rank p50 of 12
                    f"{kvindex_p99 * 1e3:.3f}",
                    f"{kvindex_p99 / floor_p99:.2f}x",
                ]
            ]
        )
        sides = [row for row in rows if row[:2] == ["kvindex", kind] and row[2] != "every answer"]
        assert 11 <= sum(row[3] for row in sides) <= 12  # all but the first request's, which has no side


def test_against_baseline_splits_on_and_off_the_clients_cpu() -> None:
    observer = PlacementObserver(["one", "base"], [1, 2], [True, False])
    on, off = "same CPU as before, on the client's", "moved CPU, off the client's"
    placed = {
        "first request": [0.009],
        on: [0.001, 0.002],
        "moved CPU, on the client's": [0.003],
        off: [0.004, 0.006, 0.005],
    }
    for group, samples in placed.items():
        observer.by_placement[("one", "hashes", group)] = samples
        observer.every[("one", "hashes")].samples_s.extend(samples)
    observer.every[("base", "hashes")].samples_s.extend([0.010, 0.002, 0.004, 0.008])
    observer.by_placement[("one", "tokens", off)] = [0.002]  # the baseline answered no token request
    observer.every[("one", "tokens")].samples_s.append(0.002)
    assert against_baseline(observer, "base") == [
        ["base", "hashes", "every answer", 4, "100%", "8.000", "10.000", "1.00x"],
        ["one", "hashes", "every answer", 7, "100%", "4.000", "9.000", "0.90x"],
        ["one", "hashes", "on the client's CPU", 3, "43%", "2.000", "3.000", "0.30x"],
        ["one", "hashes", "off the client's CPU", 3, "43%", "5.000", "6.000", "0.60x"],
        ["one", "tokens", "every answer", 1, "100%", "2.000", "2.000", "-"],
        ["one", "tokens", "off the client's CPU", 1, "100%", "2.000", "2.000", "-"],
    ]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_apart_pins_every_answer_off_the_clients_cpu() -> None:
    before = os.sched_getaffinity(0)
    spec = WorkloadSpec(num_engines=3, blocks_per_engine=64, num_prefixes=2, num_queries=6)
    observer = measure(spec, passes=1, with_dynamo=False, apart=True, c_floor=True)
    assert os.sched_getaffinity(0) == before  # the client's CPUs are given back
    groups = {group for (_, _, group) in observer.by_placement}
    assert groups and all(group == "first request" or group.endswith("off the client's") for group in groups)
    assert sum(map(len, observer.by_placement.values())) == 3 * 3 * 6  # kvindex and both floors
