"""Smoke test: `python -m benchmarks.index --quick` runs end to end and prints both tables."""

from __future__ import annotations

import pytest
from bench_support import run_quick

pytestmark = pytest.mark.timeout(120)


def test_index_benchmark_quick() -> None:
    lines = run_quick("benchmarks.index", timeout_s=100)
    assert lines[0].startswith("index: 10 pods x 1000 blocks")
    readers = ("lookup", "lookup_ids", "score_prefix")
    rows = [line for line in lines if line.startswith(("dict-of-sets", "KVIndex"))]
    apply_rows = [line for line in rows if line.split()[-3] not in readers]
    # the baseline, then KVIndex on 1 and 4 shards on the compiled core and on the pure one
    assert len(apply_rows) == 5
    for row in apply_rows:
        assert " 10000 " in row  # every (pod, block) pair of the workload ended up in the index
        float(row.split()[-1])  # RSS bytes per pair (its size is noise at this scale)
    reads = [(line.split()[0], line.split()[-3]) for line in rows if line.split()[-3] in readers]
    assert reads == [("dict-of-sets", "lookup")] + [("KVIndex", read) for read in readers] * 4
