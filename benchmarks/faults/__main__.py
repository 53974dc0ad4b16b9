"""`python -m benchmarks.faults --schedules N [--seed S] [--jobs J]`: run N seeded fault schedules
(seeds S, S+1, ...) against kvindex and print a table per fault kind — schedules, exact,
partial-but-flagged, flagged though the ring held the history, divergent — then the failing seeds and
the shortest failing schedule the shrinker finds for the first of them (`--shrink K`: the first K)."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import time
from collections.abc import Iterator, Sequence

from benchmarks.faults.driver import Outcome, quiet_kvindex_logs, run_schedule
from benchmarks.faults.report import explain, failing_seeds, kind_table
from benchmarks.faults.schedule import (
    DEFAULT_OPTIONS,
    STEP_KINDS,
    GenerateOptions,
    Schedule,
    format_schedule,
    from_json,
    generate,
)
from benchmarks.faults.verdict import is_failure


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_weights(text: str | None) -> dict[str, float]:
    weights = {kind: 1.0 for kind in STEP_KINDS}
    if not text:
        return weights
    for item in text.split(","):
        kind, _, value = item.partition("=")
        if kind not in weights:
            raise SystemExit(f"--weights: unknown fault kind {kind!r} (one of {', '.join(STEP_KINDS)})")
        weights[kind] = float(value)
    return weights


def run_all(schedules: Sequence[Schedule], jobs: int) -> Iterator[Outcome]:
    """Outcomes as they finish (in order), so progress shows while a long run goes on."""
    if jobs <= 1:
        for schedule in schedules:
            yield run_schedule(schedule)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=context, initializer=quiet_kvindex_logs
    ) as pool:
        yield from pool.map(run_schedule, schedules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=100, help="how many schedules (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first schedule (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="schedules run at once, each in its own process")
    parser.add_argument(
        "--weights", help=f"fault kind=weight,... (kinds: {', '.join(STEP_KINDS)}; default 1 each)"
    )
    parser.add_argument(
        "--process-share",
        type=float,
        default=DEFAULT_OPTIONS.process_share,
        help="share of schedules run against a `kvindex serve` subprocess (kill -9, SIGSTOP); default %(default)s",
    )
    parser.add_argument(
        "--shrink", type=int, default=1, help="shrink the first K failing schedules (default 1)"
    )
    parser.add_argument("--shrink-seconds", type=float, default=300.0, help="budget per shrink (default 300)")
    parser.add_argument("--show", action="store_true", help="print the schedules and exit")
    parser.add_argument("--replay", metavar="JSON", help="run this one schedule (as printed 'as data')")
    parser.add_argument("--quick", action="store_true", help="4 schedules, no shrinking (smoke test)")
    args = parser.parse_args(argv)
    quiet_kvindex_logs()

    options = GenerateOptions(weights=parse_weights(args.weights), process_share=args.process_share)
    if args.replay:
        schedules = [from_json(args.replay)]
    else:
        count = 4 if args.quick else args.schedules
        schedules = [generate(args.seed + i, options) for i in range(count)]
    if args.show:
        for schedule in schedules:
            print(format_schedule(schedule) + "\n")
        return 0

    started = time.monotonic()
    outcomes: list[Outcome] = []
    for outcome in run_all(schedules, args.jobs):
        outcomes.append(outcome)
        log(
            f"[{len(outcomes)}/{len(schedules)}] seed {outcome.schedule.seed}: {outcome.outcome} ({outcome.seconds:.1f} s)"
        )
    elapsed = time.monotonic() - started
    print(kind_table(outcomes))
    failing = failing_seeds(outcomes)
    print(f"\n{len(outcomes)} schedules in {elapsed:.0f} s; {len(failing)} failing")
    for line in failing:
        print(f"  {line}")
    if args.quick:
        return 0
    for outcome in [o for o in outcomes if is_failure(o.outcome)][: args.shrink]:
        log(f"shrinking seed {outcome.schedule.seed} ...")
        print("\n" + explain(outcome, max_runs=200, max_seconds=args.shrink_seconds).describe())
    if failing:
        options_text = (
            f" --process-share {args.process_share}"
            if args.process_share != DEFAULT_OPTIONS.process_share
            else ""
        )
        print(f"\nrun one again: python -m benchmarks.faults --schedules 1 --seed SEED{options_text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
