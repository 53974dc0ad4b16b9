"""`python -m benchmarks.hashing --quick` runs end to end and prints its table (no timing assertions)."""

from __future__ import annotations

from bench_support import run_quick


def test_quick_benchmark_prints_a_row_per_algorithm_and_workload() -> None:
    lines = run_quick("benchmarks.hashing", timeout_s=240)
    assert any("speed-up" in line for line in lines)
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for workload in ("cold", "zipf", "hot"):
            assert any(line.split()[:2] == [algo, workload] for line in lines), (algo, workload)
    bounded = lines.index(next(line for line in lines if line.startswith("bounded hashing")))
    held_rows = [line.split()[0] for line in lines[bounded + 3 : bounded + 7]]
    assert held_rows == ["0", "16", "256", "512"]
