"""Smoke test: `python -m benchmarks.store --quick` runs end to end on a real redis-server (memory store,
Redis with 1 and 2 writing replicas, a kill -9 failover) and prints its table."""

from __future__ import annotations

from typing import Any

import pytest
from bench_support import run_quick

pytestmark = pytest.mark.timeout(150)


def test_store_benchmark_quick(redis_server: Any) -> None:  # the fixture: skip/fail without redis-server
    lines = run_quick("benchmarks.store", 130, "--lease-ttl", "2")
    assert lines[0].startswith("== store: 10 pods x 1000 blocks")
    rows = [line for line in lines if line.startswith(("memory store", "Redis,"))]
    assert [row.split("  ")[0] for row in rows] == [
        "memory store (KVIndex)",
        "Redis, 1 replica",
        "Redis, 2 replicas",
    ]
    failover = next(line for line in lines if line.startswith("failover"))
    assert float(failover.rsplit(" in ", 1)[1].removesuffix(" s")) < 2 + 10
