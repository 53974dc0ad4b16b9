"""Smoke test: `python -m benchmarks.load --quick` (and `--soak --quick`) run end to end against a real
`kvindex serve`, engine fleet and load generator, answer every score request, and print their tables.
No timing assertions: only that nothing failed and the figures are there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import run_quick

pytestmark = pytest.mark.timeout(60)


def _row(lines: list[str], label: str) -> list[str]:
    return next(line for line in lines if line.startswith(label + " ")).split()


def test_load_quick_answers_every_request(tmp_path: Path) -> None:
    results = tmp_path / "load.json"
    lines = run_quick("benchmarks.load", 40, "--json", str(results))
    assert lines[0].startswith("== load: 8s after a 2s warm-up, 20 engines")
    row = _row(lines, "all")
    assert int(row[1].replace(",", "")) > 0 and row[2] == "0", row  # requests, errors
    assert _row(lines, "errors")[1] == "0"
    for measure in (
        "RSS after warm-up MiB",
        "RSS at end MiB",
        "RSS slope MiB/min",
        "load average start / end",
    ):
        assert any(line.startswith(measure) for line in lines), measure
    report = json.loads(results.read_text())
    assert report["load"]["all"]["errors"] == 0
    assert report["counters_delta"]["hash_mismatches"] == 0  # the fleet hashes as kvindex does
    assert report["memory"]["slope_mib_per_min"] is not None
    assert report["keys_max"] > 0


def test_soak_quick_restarts_engines_within_the_caps(tmp_path: Path) -> None:
    results = tmp_path / "soak.json"
    lines = run_quick("benchmarks.load", 40, "--soak", "--json", str(results))
    assert _row(lines, "all")[2] == "0"
    assert any(line.startswith("== soak:") for line in lines)
    report = json.loads(results.read_text())
    assert report["load"]["all"]["errors"] == 0
    assert report["fleet"]["restarts"] > 0 and report["counters_delta"]["restarts"] > 0
    assert report["cap"]["keys_within_cap"], (report["keys_max"], report["cap"])
