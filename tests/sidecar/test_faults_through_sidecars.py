"""Engine -> sidecar -> kvindex under the fault harness's lifecycle schedules (benchmarks/faults with
`sidecars=True`: connect mode, kvindex in process, a sidecar per pod with a ring of 8 and the engine's
PUB high-water mark). The rule is the harness's, judged against each engine's own cache: exact wherever
the engine's ring held the history — now also when kvindex's own gap (a stall, a restart) is far older
than the sidecar's ring, since kvindex resyncs from the sidecar's snapshot."""

from __future__ import annotations

import msgspec
import pytest

from benchmarks.faults.driver import SIDECAR_RING, Outcome, run_many, run_schedule
from benchmarks.faults.report import explain
from benchmarks.faults.schedule import Burst, EngineSpec, GenerateOptions, Schedule, Step, generate
from benchmarks.faults.verdict import is_failure

START = Step("kvindex_start", pause_ms=300)


def expect_exact_or_allowed(outcome: Outcome) -> Outcome:
    if is_failure(outcome.outcome):
        pytest.fail(explain(outcome, max_runs=10, max_seconds=30).describe(), pytrace=False)
    return outcome


def with_sidecars(steps: list[Step], specs: tuple[EngineSpec, ...]) -> Schedule:
    return Schedule(
        seed=0,
        mode="connect",
        runner="inproc",
        engines=specs,
        steps=tuple(steps),
        prefix_seed=7,
        sidecars=True,
    )


def test_kvindex_stalled_far_past_the_sidecars_ring_is_exact_not_flagged() -> None:
    """Without a sidecar this is test_gap_older_than_the_ring's case for kvindex (flagged); here the
    engine's ring is whole, so the sidecar is exact and kvindex resyncs from its snapshot: exact."""
    spec = EngineSpec("p0.0", "p0", hwm=1)
    steps = [
        START,
        Step("requests", "p0.0", n=3, seed=1, pause_ms=50),
        Step("stall", ms=300, bursts=(Burst("p0.0", 10 * SIDECAR_RING, 2),)),
    ]
    outcome = expect_exact_or_allowed(run_schedule(with_sidecars(steps, (spec,))))
    assert outcome.outcome == "exact", outcome.describe()


def test_kvindex_restart_while_more_than_the_sidecars_ring_passes_is_exact() -> None:
    steps = [
        START,
        Step("requests", "p0.0", n=10, seed=1),
        Step(
            "kvindex_restart",
            ms=200,
            bursts=(Burst("p0.0", 6 * SIDECAR_RING, 2), Burst("p1.0", 4 * SIDECAR_RING, 3)),
        ),
        Step("requests", "p0.0", n=3, seed=4),
    ]
    specs = (EngineSpec("p0.0", "p0"), EngineSpec("p1.0", "p1"))
    outcome = expect_exact_or_allowed(run_schedule(with_sidecars(steps, specs)))
    assert outcome.outcome == "exact", outcome.describe()


def test_engine_restart_and_dp_ranks_behind_a_sidecar() -> None:
    specs = (EngineSpec("p0.0", "p0", 0, hwm=2), EngineSpec("p0.1", "p0", 1, hwm=2))
    steps = [
        START,
        Step("requests", "p0.0", n=8, seed=1),
        Step("requests", "p0.1", n=6, seed=2, pause_ms=100),
        Step("restart", "p0.1", n=3, seed=5, pause_ms=100),
        Step("stall", ms=300, bursts=(Burst("p0.0", 40, 6), Burst("p0.1", 40, 7))),
    ]
    outcome = expect_exact_or_allowed(run_schedule(with_sidecars(steps, specs)))
    assert outcome.outcome == "exact", outcome.describe()


# --- seeded schedules ---------------------------------------------------------------------------------

CONNECT_INPROC = GenerateOptions(process_share=0.0, bind_share=0.0)
SEEDS = list(range(5000, 5024))


@pytest.fixture(scope="module")
def seeded_outcomes() -> dict[int, Outcome]:
    schedules = [msgspec.structs.replace(generate(seed, CONNECT_INPROC), sidecars=True) for seed in SEEDS]
    return {outcome.schedule.seed: outcome for outcome in run_many(schedules, jobs=3)}


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_schedule_through_a_sidecar(seed: int, seeded_outcomes: dict[int, Outcome]) -> None:
    expect_exact_or_allowed(seeded_outcomes[seed])
