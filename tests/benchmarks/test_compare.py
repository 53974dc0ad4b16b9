"""benchmarks/compare.py's paired idle timing: two real `kvindex serve` processes, each fed the same vLLM
event bytes by its own publisher process, asked the same prompts in turn; every answer is checked against
the workload's brute-force overlaps."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest

from benchmarks import compare
from benchmarks.compare import (
    Feed,
    KvindexSubject,
    Publishers,
    Subject,
    SubjectResult,
    _requests,
    _time_during_ingest,
    build,
    ingest_first_round,
    run_round,
    start_subject,
    time_queries_paired,
)
from benchmarks.floor import FloorServer
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


def test_the_floor_is_timed_in_turn_with_the_services_and_left_unchecked() -> None:
    feed = build(
        WorkloadSpec(num_engines=3, blocks_per_engine=64, num_prefixes=2, num_queries=5), lambda _: None
    )
    with ExitStack() as stack:
        publishers = stack.enter_context(Publishers(feed.payloads))
        subject = stack.enter_context(start_subject("kvindex", publishers, feed))
        ingest_first_round(
            subject, publishers, SubjectResult("kvindex", feed.num_blocks), ingest_timeout_s=60
        )
        floor = stack.enter_context(FloorServer(b"[]"))
        requests = [_requests(subject, feed, ("tokens", "hashes"))]
        service, floor_latencies = time_queries_paired([subject], feed, requests, (floor.port,))
    for kind in ("tokens", "hashes"):
        assert service[kind].checked == service[kind].correct == 5
        assert len(floor_latencies[kind].samples_s) == 5 and floor_latencies[kind].checked == 0


def test_a_round_reports_the_floor_beside_the_services() -> None:
    feed = build(
        WorkloadSpec(num_engines=2, blocks_per_engine=64, num_prefixes=2, num_queries=4), lambda _: None
    )
    results = run_round(
        ("kvindex",), feed, measure_during=False, query_kinds=("tokens",), ingest_timeout_s=60, log=print
    )
    assert set(results) == {"kvindex", "floor"}
    assert results["kvindex"].idle["tokens"].correct == 4
    floor = results["floor"]
    assert len(floor.idle["tokens"].samples_s) == 4 and floor.error is None and floor.ingest_s is None


def test_a_feed_without_queries_times_no_floor() -> None:
    feed = build(WorkloadSpec(num_engines=2, blocks_per_engine=64, num_queries=0), lambda _: None, lean=True)
    results = run_round(
        ("kvindex",), feed, measure_during=False, query_kinds=("tokens",), ingest_timeout_s=60, log=print
    )
    assert set(results) == {"kvindex"} and results["kvindex"].error is None


def test_a_service_that_fails_to_ingest_is_reported_and_the_round_still_ends() -> None:
    feed = build(
        WorkloadSpec(num_engines=2, blocks_per_engine=64, num_prefixes=2, num_queries=4), lambda _: None
    )
    # One event more than the publishers send: the service can never catch up, however fast it is (with
    # the true count a tiny feed could be ingested before the first check, and nothing timed out).
    unreachable = replace(feed, num_events=feed.num_events + 1)
    logged: list[str] = []
    results = run_round(
        ("kvindex",),
        unreachable,
        measure_during=True,
        query_kinds=("tokens",),
        ingest_timeout_s=0.0,  # no service ingests anything in no time
        log=logged.append,
    )
    (result,) = results.values()
    assert result.error == "TimeoutError: kvindex did not ingest round 0 in 0s"
    assert result.idle == {} and result.during == {}
    assert logged == ["  kvindex failed: TimeoutError: kvindex did not ingest round 0 in 0s"]


def during_setup(stack: ExitStack, num_queries: int) -> tuple[Feed, Publishers, Subject, SubjectResult]:
    feed = build(
        WorkloadSpec(num_engines=2, blocks_per_engine=64, num_prefixes=2, num_queries=num_queries),
        lambda _: None,
    )
    publishers = stack.enter_context(Publishers(feed.payloads))
    subject = stack.enter_context(start_subject("kvindex", publishers, feed))
    result = SubjectResult("kvindex", feed.num_blocks)
    ingest_first_round(subject, publishers, result, ingest_timeout_s=60)
    return feed, publishers, subject, result


def test_queries_under_ingest_go_on_over_rounds_until_each_kind_has_its_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tiny feed is ingested within a few queries: one round cannot give 30 samples of each kind.
    monkeypatch.setattr(compare, "DURING_MIN_SAMPLES", 30)
    monkeypatch.setattr(compare, "DURING_MAX_ROUNDS", 40)
    with ExitStack() as stack:
        feed, publishers, subject, result = during_setup(stack, num_queries=3)
        requests = _requests(subject, feed, ("tokens", "hashes", "tokens_full"))
        _time_during_ingest(subject, publishers, feed, requests, result, ingest_timeout_s=60)
        assert isinstance(subject, KvindexSubject)
        rounds_published = subject.service.events_applied() // subject.events_per_round
    assert set(result.during) == {"tokens", "hashes"}  # not the full-answer row
    for latencies in result.during.values():
        assert len(latencies.samples_s) >= 30
        assert latencies.checked == latencies.correct == len(latencies.samples_s)
    # Each round times every query at least once (3 of each kind): 30 are reached within 10 rounds, and
    # no round is published after that.
    assert 2 <= rounds_published <= 1 + 10
    assert result.during_ingest_s is not None and result.during_ingest_s > 0


def test_queries_under_ingest_stop_after_the_last_round_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "DURING_MIN_SAMPLES", 10**9)  # never reached
    monkeypatch.setattr(compare, "DURING_MAX_ROUNDS", 3)
    with ExitStack() as stack:
        feed, publishers, subject, result = during_setup(stack, num_queries=2)
        _time_during_ingest(
            subject, publishers, feed, _requests(subject, feed, ("hashes",)), result, ingest_timeout_s=60
        )
        assert isinstance(subject, KvindexSubject)
        # every event of rounds 0-3 applied, and not one more round started
        assert subject.service.events_applied() == 4 * subject.events_per_round
    hashes = result.during["hashes"]
    assert 3 * 2 <= len(hashes.samples_s) == hashes.checked == hashes.correct
