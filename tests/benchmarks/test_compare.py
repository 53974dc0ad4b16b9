"""benchmarks/compare.py's paired idle timing: two real `kvindex serve` processes, each fed the same vLLM
event bytes by its own publisher process, asked the same prompts in turn; every answer is checked against
the workload's brute-force overlaps."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from benchmarks.compare import (
    Publishers,
    SubjectResult,
    _requests,
    build,
    ingest_first_round,
    run_round,
    start_subject,
    time_queries_paired,
)
from benchmarks.workload import WorkloadSpec

pytestmark = pytest.mark.timeout(180)


def test_two_services_are_timed_in_turn_and_every_answer_is_checked() -> None:
    feed = build(
        WorkloadSpec(num_engines=3, blocks_per_engine=64, num_prefixes=2, num_queries=6), lambda _: None
    )
    with ExitStack() as stack:
        subjects = []
        for _ in range(2):
            publishers = stack.enter_context(Publishers(feed.payloads))
            subject = stack.enter_context(start_subject("kvindex", publishers, feed))
            result = SubjectResult("kvindex", feed.num_blocks)
            ingest_first_round(subject, publishers, result, ingest_timeout_s=60)
            assert result.ingest_s is not None and result.rss_after is not None
            subjects.append(subject)
        requests = [_requests(subject, feed, ("tokens", "hashes")) for subject in subjects]
        timed = time_queries_paired(subjects, feed, requests)
    assert len(timed) == 2
    for latencies in timed:
        for kind in ("tokens", "hashes"):
            assert len(latencies[kind].samples_s) == latencies[kind].checked == len(feed.queries) == 6
            assert latencies[kind].correct == 6
            assert all(sample > 0 for sample in latencies[kind].samples_s)


def test_a_service_that_fails_to_ingest_is_reported_and_the_round_still_ends() -> None:
    feed = build(
        WorkloadSpec(num_engines=2, blocks_per_engine=64, num_prefixes=2, num_queries=4), lambda _: None
    )
    logged: list[str] = []
    results = run_round(
        ("kvindex",),
        feed,
        measure_during=True,
        query_kinds=("tokens",),
        ingest_timeout_s=0.0,  # no service ingests anything in no time
        log=logged.append,
    )
    (result,) = results.values()
    assert result.error == "TimeoutError: kvindex did not ingest round 0 in 0s"
    assert result.idle == {} and result.during == {}
    assert logged == ["  kvindex failed: TimeoutError: kvindex did not ingest round 0 in 0s"]
