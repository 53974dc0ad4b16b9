"""Smoke test: `python -m benchmarks.index --quick` runs end to end and prints both tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_index_benchmark_quick() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.index", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("index: 10 pods x 1000 blocks")
    apply_rows = [line for line in lines if line.startswith(("dict-of-sets", "KVIndex")) and "," in line]
    assert len(apply_rows) == 3
    for row in apply_rows:
        assert " 10000 " in row  # every (pod, block) pair of the workload ended up in the index
    read_rows = [line.split() for line in lines if line.split()[-3:-2] and line.split()[3:4]]
    reads = [
        row[3]
        for row in read_rows
        if row[0] == "KVIndex" and row[3] in ("lookup_ids", "lookup", "score_prefix")
    ]
    assert reads == ["lookup_ids", "lookup", "score_prefix"] * 2
