"""`python -m benchmarks.decode --quick` runs from the repository root and prints every row of its table."""

from __future__ import annotations

from bench_support import run_quick


def test_decode_benchmark_quick() -> None:
    stdout = "\n".join(run_quick("benchmarks.decode", timeout_s=120))
    for row in ("msgpack.decode (baseline)", "decode_batch", "token ids skipped", "per-event", "publisher"):
        assert row in stdout
