"""Smoke test of `python -m benchmarks.ingest`: a tiny fleet goes through end to end."""

from __future__ import annotations

from benchmarks.ingest import main, run


def test_small_run_ingests_every_block() -> None:
    rows = run(num_pods=3, blocks_per_pod=300)
    by_name = {row[0]: row for row in rows}
    assert by_name["RSS per (pod, block) entry"][2] == "900 entries"
    assert by_name["gaps / replays / hash mismatches"][1].endswith("/ 0")  # hashes agree


def test_cli_quick_prints_a_table(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--quick"]) == 0
    assert "blocks/s" in capsys.readouterr().out
