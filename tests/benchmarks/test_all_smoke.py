"""`python -m benchmarks --quick` runs every workload end to end (real `kvindex serve`, real ZMQ publisher
process, Dynamo too where installed) and prints the side-by-side tables and the target summary.
No timing assertions: only that it completes, answers are checked correct, and results are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )


def test_quick_run_prints_every_table_and_the_summary(tmp_path: Path) -> None:
    results_path = tmp_path / "results.json"
    result = _run(["--quick", "--json", str(results_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("Dynamo: ")
    for heading in (
        "== ingest:",
        "== score:",
        "== memory:",
        "== hashing:",
        "== scale:",
        "== store:",
        "== summary:",
    ):
        assert heading in out, heading
    for target in ("ingest blocks/s, main workload", "memory per pair, main workload", "hashing sha256 hot"):
        assert target in out
    assert "WRONG" not in out, out  # every timed answer matched the brute-force overlaps
    report = json.loads(results_path.read_text())
    kvindex = report["main"]["kvindex"]
    assert kvindex["error"] is None
    assert kvindex["pairs"] == 4 * 200
    assert kvindex["idle"]["tokens"]["correct"] == kvindex["idle"]["tokens"]["checked"] == 20
    assert kvindex["idle"]["hashes"]["correct"] == 20
    assert len(report["scale"]) == 3


def test_without_dynamo_the_run_says_why_and_still_completes(tmp_path: Path) -> None:
    env = dict(os.environ, KVINDEX_DYNAMO_PYTHON=str(tmp_path / "no-such-python"))
    result = _run(["--quick", "--only", "ingest,score", "--json", str(tmp_path / "r.json")], env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Dynamo: not available (no Dynamo interpreter at")
    assert "== summary:" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["main"]) == {"kvindex"}


def test_unknown_workload_is_refused_with_the_choices() -> None:
    result = _run(["--only", "ingest,speed"])
    assert result.returncode == 2
    assert "unknown workload(s) speed" in result.stderr


def test_lean_payloads_are_the_bytes_of_the_full_workload() -> None:
    from benchmarks.workload import WorkloadSpec, build_payloads, build_workload, encode_engine

    spec = WorkloadSpec(num_engines=3, blocks_per_engine=300, num_prefixes=2, num_queries=0, seed=5)
    workload = build_workload(spec)
    payloads, num_events, num_blocks = build_payloads(spec)
    assert payloads == [encode_engine(engine) for engine in workload.engines]
    assert (num_events, num_blocks) == (workload.num_events, workload.num_blocks) == (num_events, 900)
