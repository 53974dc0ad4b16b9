"""Smoke test: `python -m benchmarks.store --quick` runs end to end on a real redis-server (memory store,
Redis with 1 and 2 writing replicas, a kill -9 failover, /v1/score of kvindex serve on either store) and
prints its tables."""

from __future__ import annotations

from typing import Any

import pytest
from bench_support import run_quick

pytestmark = pytest.mark.timeout(150)


def test_store_benchmark_quick(redis_server: Any) -> None:  # the fixture: skip/fail without redis-server
    lines = run_quick("benchmarks.store", 130, "--lease-ttl", "2")
    assert lines[0].startswith("== store: 10 pods x 1000 blocks")
    rows = [line for line in lines if line.startswith(("memory store (", "Redis,"))]
    assert [row.split("  ")[0] for row in rows] == [
        "memory store (KVIndex)",
        "Redis, 1 replica",
        "Redis, 2 replicas",
    ]
    failover = next(line for line in lines if line.startswith("failover"))
    assert float(failover.rsplit(" in ", 1)[1].removesuffix(" s")) < 2 + 10
    http = lines[lines.index("== /v1/score end to end (kvindex serve, HTTP keep-alive client, idle):") :]
    http_rows = [line.split() for line in http if line.startswith(("memory store ", "Redis "))]
    assert [(row[0], row[-1]) for row in http_rows] == [
        ("memory", "20/20"),
        ("memory", "20/20"),
        ("Redis", "20/20"),
        ("Redis", "20/20"),
    ]
