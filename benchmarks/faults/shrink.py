"""Fault harness, shrinking: the shortest schedule that still fails, by delta debugging.

Steps are removed in halves, then quarters, ... then one at a time (Zeller's ddmin, testing
complements); then engines no step names are dropped, then burst sizes halved. Every candidate is a
full run, so a flaky failure can stop the shrink early; the budget bounds runs and seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from benchmarks.faults.schedule import Burst, Schedule, Step, removable_steps


class ShrinkResult(msgspec.Struct, frozen=True):
    original: Schedule
    shrunk: Schedule
    runs: int
    seconds: float
    exhausted: bool  # the budget ran out before no smaller failing schedule was left to try


class _Budget:
    def __init__(self, max_runs: int, max_seconds: float) -> None:
        self.max_runs = max_runs
        self.deadline = time.monotonic() + max_seconds
        self.runs = 0

    def spent(self) -> bool:
        return self.runs >= self.max_runs or time.monotonic() > self.deadline


def shrink(
    schedule: Schedule,
    fails: Callable[[Schedule], bool],
    *,
    max_runs: int = 60,
    max_seconds: float = 120.0,
    on_accept: Callable[[Schedule], None] | None = None,
) -> ShrinkResult:
    """Shrink a schedule `fails` is true of (it is not re-checked) to a smaller one it is still true of."""
    started = time.monotonic()
    budget = _Budget(max_runs, max_seconds)

    def check(candidate: Schedule) -> bool:
        if budget.spent():
            return False
        budget.runs += 1
        if fails(candidate):
            if on_accept is not None:
                on_accept(candidate)
            return True
        return False

    current = _remove_steps(schedule, check, budget)
    current = _drop_idle_engines(current, check)
    current = _halve_sizes(current, check, budget)
    return ShrinkResult(
        original=schedule,
        shrunk=current,
        runs=budget.runs,
        seconds=time.monotonic() - started,
        exhausted=budget.spent(),
    )


def _remove_steps(schedule: Schedule, check: Callable[[Schedule], bool], budget: _Budget) -> Schedule:
    current = schedule
    granularity = 2
    while not budget.spent():
        removable = removable_steps(current)
        if not removable:
            break
        granularity = min(granularity, len(removable))
        size = -(-len(removable) // granularity)
        chunks = [removable[i : i + size] for i in range(0, len(removable), size)]
        for chunk in chunks:
            candidate = current.without_steps(chunk)
            if check(candidate):
                current = candidate
                granularity = max(granularity - 1, 2)
                break
        else:
            if granularity >= len(removable):
                break
            granularity = min(2 * granularity, len(removable))
    return current


def _drop_idle_engines(schedule: Schedule, check: Callable[[Schedule], bool]) -> Schedule:
    named = {name for step in schedule.steps for name in step.engines()}
    idle = [spec for spec in schedule.engines if spec.name not in named]
    if not idle:
        return schedule
    candidate = msgspec.structs.replace(
        schedule, engines=tuple(spec for spec in schedule.engines if spec.name in named)
    )
    if named and check(candidate):
        return candidate
    current = schedule
    for spec in idle:
        candidate = msgspec.structs.replace(
            current, engines=tuple(other for other in current.engines if other is not spec)
        )
        if candidate.engines and check(candidate):
            current = candidate
    return current


def _halve_sizes(schedule: Schedule, check: Callable[[Schedule], bool], budget: _Budget) -> Schedule:
    current = schedule
    changed = True
    while changed and not budget.spent():
        changed = False
        for index, step in enumerate(current.steps):
            smaller = _halved(step)
            if smaller is None:
                continue
            steps = list(current.steps)
            steps[index] = smaller
            candidate = msgspec.structs.replace(current, steps=tuple(steps))
            if check(candidate):
                current = candidate
                changed = True
    return current


def _halved(step: Step) -> Step | None:
    """The step with every batch count halved (rounded down, at least 1), or None if nothing shrinks."""
    bursts = tuple(Burst(b.engine, max(1, b.n // 2), b.seed) for b in step.bursts)
    n = max(1, step.n // 2) if step.n > 1 else step.n
    if n == step.n and bursts == step.bursts:
        return None
    return msgspec.structs.replace(step, n=n, bursts=bursts)
