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
    assert set(report["main"]) == {"kvindex", "floor"}  # the floor needs no Dynamo


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


def test_two_rounds_run_the_service_twice_and_pool_its_requests(tmp_path: Path) -> None:
    env = dict(os.environ, KVINDEX_DYNAMO_PYTHON=str(tmp_path / "no-such-python"))
    args = ["--quick", "--only", "ingest,score", "--rounds", "2", "--json", str(tmp_path / "r.json")]
    result = _run(args, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rounds: 2 per service and workload" in result.stdout
    assert result.stderr.count("kvindex: 4 engines x 200 blocks (round") == 2
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rounds"] == 2
    idle = report["main"]["kvindex"]["idle"]
    assert idle["tokens"]["checked"] == idle["tokens"]["correct"] == 40  # 20 prompts per round


def test_rounds_below_one_are_refused() -> None:
    result = _run(["--rounds", "0"])
    assert result.returncode == 2
    assert "--rounds must be at least 1, got 0" in result.stderr


def test_merged_rounds_take_the_median_ingest_and_pool_every_rounds_latencies() -> None:
    from benchmarks.compare import Latencies, SubjectResult, merge_rounds

    def round_of(ingest_s: float, samples: list[float], error: str | None = None) -> SubjectResult:
        return SubjectResult(
            "kvindex",
            pairs=1000,
            ingest_s=ingest_s,
            rss_before=0,
            rss_after=int(ingest_s * 1000),
            idle={"tokens": Latencies(samples, checked=len(samples), correct=len(samples))},
            error=error,
        )

    merged = merge_rounds(
        [
            round_of(3.0, [0.3]),
            round_of(1.0, [0.1, 0.2]),
            round_of(9.0, [], "TimeoutError"),
            round_of(2.0, [0.4]),
        ]
    )
    # rounds that ran: 1.0, 2.0, 3.0 s; the median is 2.0 s, and its memory figure comes with it
    assert merged.ingest_s == 2.0 and merged.rss_after == 2000 and merged.error is None
    assert sorted(merged.idle["tokens"].samples_s) == [0.1, 0.2, 0.3, 0.4]
    assert merged.idle["tokens"].checked == 4
    failed = merge_rounds([round_of(1.0, [], "RuntimeError: a"), round_of(1.0, [], "RuntimeError: b")])
    assert failed.error == "RuntimeError: b"
