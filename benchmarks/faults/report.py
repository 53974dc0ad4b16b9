"""Fault harness, what gets printed: the table per fault kind, and for a failing schedule its seed, the
shortest failing schedule the shrinker found and why it fails, plus how to run it again."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from benchmarks._table import format_table
from benchmarks.faults.driver import Outcome, run_schedule
from benchmarks.faults.schedule import FAULT_KINDS, Schedule, format_schedule, kinds_of, to_json
from benchmarks.faults.shrink import ShrinkResult, shrink
from benchmarks.faults.verdict import is_failure

COLUMNS = ("exact", "flagged", "unseen", "flagged_needlessly", "divergent", "error")
HEADERS = (
    "fault kind",
    "schedules",
    "exact",
    "partial-but-flagged",
    "unseen (bind)",
    "flagged, ring held it",
    "divergent",
    "error",
)


def kind_table(outcomes: Sequence[Outcome]) -> str:
    """One row per fault kind (a schedule counts under every kind it has), then all schedules."""
    rows: list[list[object]] = []
    for kind in (*FAULT_KINDS, "subprocess", "all"):
        if kind == "all":
            picked = list(outcomes)
        elif kind == "subprocess":
            picked = [o for o in outcomes if o.schedule.runner == "process"]
        else:
            picked = [o for o in outcomes if kind in kinds_of(o.schedule)]
        if not picked and kind != "all":
            continue
        counts = [sum(1 for o in picked if o.outcome == column) for column in COLUMNS]
        rows.append([kind, len(picked), *counts])
    return format_table(HEADERS, rows)


def failing_seeds(outcomes: Sequence[Outcome]) -> list[str]:
    """`seed: outcome (kinds) - first bad pod` per failing schedule."""
    lines = []
    for outcome in outcomes:
        if not is_failure(outcome.outcome):
            continue
        bad = next((v for v in outcome.pods if v.outcome == outcome.outcome), None)
        if bad is not None:
            why = bad.describe()
        else:
            why = ((outcome.error or "").strip().splitlines() or ["?"])[-1]
        kinds = ",".join(sorted(kinds_of(outcome.schedule)))
        lines.append(f"{outcome.schedule.seed}: {outcome.outcome} [{kinds}] {why}")
    return lines


class Explained(msgspec.Struct, frozen=True):
    outcome: Outcome  # the original failing run
    shrink: ShrinkResult | None
    shrunk_outcome: Outcome | None  # the last failing run of the shrunk schedule

    def describe(self) -> str:
        schedule = self.outcome.schedule
        lines = [f"FAILING SEED {schedule.seed}", self.outcome.describe(), "", format_schedule(schedule)]
        if self.shrink is not None and self.shrunk_outcome is not None:
            shrunk = self.shrink.shrunk
            note = " (shrink budget spent)" if self.shrink.exhausted else ""
            lines += [
                "",
                f"shortest failing schedule found ({len(shrunk.steps)} of {len(schedule.steps)} steps, "
                f"{self.shrink.runs} runs, {self.shrink.seconds:.0f} s{note}):",
                format_schedule(shrunk),
                self.shrunk_outcome.describe(),
                f"as data: {to_json(shrunk)}",
            ]
        return "\n".join(lines)


def explain(outcome: Outcome, *, max_runs: int = 60, max_seconds: float = 120.0) -> Explained:
    """Shrink a failing outcome's schedule (re-running it) and keep the last failing run's verdict."""
    if max_runs <= 0 or max_seconds <= 0:
        return Explained(outcome=outcome, shrink=None, shrunk_outcome=None)
    last: dict[str, Outcome] = {}

    def fails(candidate: Schedule) -> bool:
        result = run_schedule(candidate)
        if is_failure(result.outcome):
            last["outcome"] = result
            return True
        return False

    result = shrink(outcome.schedule, fails, max_runs=max_runs, max_seconds=max_seconds)
    return Explained(outcome=outcome, shrink=result, shrunk_outcome=last.get("outcome", outcome))
