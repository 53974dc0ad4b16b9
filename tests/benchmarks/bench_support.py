"""Shared part of the benchmark smoke tests (no tests here): run `python -m benchmarks.<name> --quick`
from the repository root, the way the README tells a reader to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_quick(module: str, timeout_s: float, *args: str) -> list[str]:
    """The benchmark's stdout lines (run with `--quick` and `args`); fails the test with its stderr if it
    did not exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--quick", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()
