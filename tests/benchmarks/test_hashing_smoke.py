"""`python -m benchmarks.hashing --quick` runs end to end and prints its table (no timing assertions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_benchmark_prints_a_row_per_algorithm_and_workload() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.hashing", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("speed-up" in line for line in lines)
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for workload in ("cold", "zipf", "hot"):
            assert any(line.split()[:2] == [algo, workload] for line in lines), (algo, workload)
