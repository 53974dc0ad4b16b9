"""Dynamo's standalone indexer as a benchmark peer: fed our vLLM 0.33 payloads over real ZMQ, it must
report the overlaps the workload's brute-force model expects. Skipped where Dynamo is not installed (CI)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
import zmq

from benchmarks.dynamo import DynamoIndexer, available, dynamo_local_hashes, dynamo_python
from benchmarks.workload import Workload, WorkloadSpec, build_workload, encode_engine

DYNAMO_OK, DYNAMO_REASON = available()
pytestmark = [
    pytest.mark.skipif(not DYNAMO_OK, reason=f"Dynamo indexer not available: {DYNAMO_REASON}"),
    pytest.mark.timeout(120),
]
SPEC = WorkloadSpec(num_engines=2, blocks_per_engine=300, num_prefixes=2, num_queries=6, seed=3)


@pytest.fixture(scope="module")
def fed_dynamo() -> Iterator[tuple[DynamoIndexer, Workload]]:
    workload = build_workload(SPEC)
    ctx = zmq.Context()
    # XPUB: a PUB on the wire that also reports when Dynamo's SUB (which dials us) has subscribed.
    sockets = [ctx.socket(zmq.XPUB) for _ in workload.engines]
    try:
        for sock in sockets:
            sock.setsockopt(zmq.RCVTIMEO, 30_000)
            sock.bind("tcp://127.0.0.1:0")
        endpoints = {i + 1: s.getsockopt_string(zmq.LAST_ENDPOINT) for i, s in enumerate(sockets)}
        with DynamoIndexer(endpoints, block_size=SPEC.block_size, threads=2) as dynamo:
            for sock in sockets:
                assert sock.recv() == b"\x01"  # subscribe-to-everything from Dynamo's SUB
            for sock, engine in zip(sockets, workload.engines, strict=True):
                for seq, payload in enumerate(encode_engine(engine)):
                    sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            dynamo.wait_for_events(workload.num_events, timeout_s=30)
            yield dynamo, workload
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def _expected(workload: Workload, index: int) -> dict[int, int]:
    return {engine + 1: blocks for engine, blocks in workload.queries[index].expected_blocks.items()}


def test_token_queries_resolve_to_expected_overlap(fed_dynamo: tuple[DynamoIndexer, Workload]) -> None:
    dynamo, workload = fed_dynamo
    for index, query in enumerate(workload.queries):
        assert dynamo.query(query.token_ids) == _expected(workload, index)
    assert any(max(_expected(workload, i).values()) > SPEC.prefix_blocks for i in range(SPEC.num_queries))


def test_query_by_hash_takes_dynamo_hashes_not_vllm_ones(fed_dynamo: tuple[DynamoIndexer, Workload]) -> None:
    dynamo, workload = fed_dynamo
    query = workload.queries[0]
    assert dynamo.query_by_hash(dynamo_local_hashes(query.token_ids)) == _expected(workload, 0)
    as_i64 = [h - (1 << 64) if h >= 1 << 63 else h for h in query.event_hashes]
    assert dynamo.query_by_hash(as_i64) == {}


def test_all_stored_events_applied_ok(fed_dynamo: tuple[DynamoIndexer, Workload]) -> None:
    dynamo, workload = fed_dynamo
    assert dynamo.events_applied().get("stored") == workload.num_events
    assert dynamo.rss_bytes() > 0


def test_local_hashes_match_dynamos_own_function() -> None:
    token_ids = build_workload(SPEC).queries[0].token_ids[:160]
    script = (
        "import json, sys; from dynamo._core import compute_block_hash_for_seq as f; "
        "print(json.dumps(f(json.loads(sys.stdin.read()), 16)))"
    )
    result = subprocess.run(
        [dynamo_python(), "-c", script],
        input=json.dumps(token_ids),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    theirs = [h - (1 << 64) if h >= 1 << 63 else h for h in json.loads(result.stdout)]
    assert dynamo_local_hashes(token_ids) == theirs
