"""Smoke test: `python -m benchmarks.score --quick` runs end to end and prints its table."""

from __future__ import annotations

from bench_support import run_quick


def test_score_benchmark_quick() -> None:
    lines = run_quick("benchmarks.score", timeout_s=240)
    assert lines[0].startswith("index: 10 pods x 1000 blocks")
    rows = [line.split() for line in lines if line.startswith(("tokens/", "hashes"))]
    assert [(row[0], row[1]) for row in rows] == [
        (kind, load) for kind in ("tokens/warm", "tokens/fresh", "hashes") for load in ("idle", "ingest")
    ]
    for row in rows:
        assert int(row[2]) == 20  # every request answered 200 (the benchmark raises otherwise)
        assert float(row[3]) > 0
