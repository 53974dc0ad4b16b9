"""`python -m benchmarks.decode --quick` runs from the repository root and prints every row of its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_decode_benchmark_quick() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    for row in ("msgpack.decode (baseline)", "decode_batch", "token ids skipped", "per-event", "publisher"):
        assert row in completed.stdout
