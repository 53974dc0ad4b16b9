"""Why the idle score rows move from run to run on this box: each request, split by where its server ran.

`python -m benchmarks.placement [--quick] [--passes N] [--apart] [--c-floor]` runs the score section's idle
timing (compare.time_queries_paired: kvindex, Dynamo when available, and the floor, in turn, on the main
workload) and, outside each request's timing window, reads from /proc where each server that answers on one
thread (kvindex's event loop, the floor; Dynamo answers on a pool) ran it: on the same CPU as its previous
request or not, and on the client's CPU or not. A server woken on the other CPU than its last starts with cold
caches; one woken on the other CPU than its client's pays a cross-CPU wake-up (on this VM an idle vCPU halts
at once: cpuidle_haltpoll with guest_halt_poll_ns=0). The scheduler decides which, and a server's own work per
request weighs in: `python -m benchmarks.wake` asks floor servers that differ only in how long they compute
before answering. The one that does no work answers on the client's CPU for 94-100% of its requests, at a p50
of 0.03-0.04 ms; those computing 5 to 280 us answer there for 0-59%, and each of their answers costs 0.08-0.13
ms at p50 beyond its work. So the floor's answers on the client's CPU take a path that a server doing a
score's work mostly does not.

Prints latency percentiles per (service, request kind, placement), then each one-thread server's p99 on
and off its client's CPU over Dynamo's p99 (the floor's without Dynamo): the score table's ratio taken
apart by placement. `--apart` pins the client to one CPU and every server to the other, as a router on
another machine would be, so that no answer is given on the client's CPU; `--c-floor` times the floor
written in C as well (benchmarks/c_floor.c): what Python and its event loop add to a server that does no
work. The reads add client work between requests, outside the timed windows, so the figures are close to
but not the score table's own.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from benchmarks._process import run_main
from benchmarks._table import format_table
from benchmarks.compare import (
    FLOOR,
    Latencies,
    Publishers,
    Subject,
    SubjectResult,
    _requests,
    _start_floor,
    build,
    ingest_first_round,
    start_subject,
    time_queries_paired,
)
from benchmarks.dynamo import available
from benchmarks.floor import CFloorServer, FloorServer
from benchmarks.workload import WorkloadSpec

QUERY_KINDS = ("tokens", "hashes", "tokens_full")  # the score section's, in its order
C_FLOOR = "C floor"  # benchmarks/floor.py CFloorServer, with --c-floor
# proc(5)'s field 39 of a stat line, counted after the ")" that ends the command name (which may hold
# spaces): fields 1 and 2 come before it, so it is the 37th word after.
_PROCESSOR = 39 - 3


def thread_cpu(pid: int, tid: int) -> int:
    """The CPU thread `tid` of process `pid` last ran on."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[_PROCESSOR])


def placement_class(cpu: int, previous_cpu: int | None, client_cpu: int) -> str:
    """Where a one-thread server answered, against its previous request and its client."""
    if previous_cpu is None:
        return "first request"
    moved = "same CPU as before" if cpu == previous_cpu else "moved CPU"
    return f"{moved}, {'on' if cpu == client_cpu else 'off'} the client's"


class PlacementObserver:
    """time_queries_paired's `observe`: each timed request's latency filed under its server's placement
    class, for the servers that answer on their main thread (`placed[at]`), and under its service alone
    (`every`, every service's: the baseline's too)."""

    def __init__(self, names: Sequence[str], pids: Sequence[int], placed: Sequence[bool]) -> None:
        self._names = names
        self._pids = pids
        self._placed = placed
        self._last_cpu: list[int | None] = [None] * len(pids)
        self.by_placement: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        self.every: dict[tuple[str, str], Latencies] = defaultdict(Latencies)

    def __call__(self, at: int, kind: str, elapsed_s: float) -> None:
        self.every[(self._names[at], kind)].samples_s.append(elapsed_s)
        if not self._placed[at]:
            return
        pid = self._pids[at]
        cpu = thread_cpu(pid, pid)  # where it answered: it went back to waiting there
        client_cpu = thread_cpu(os.getpid(), threading.get_native_id())
        group = placement_class(cpu, self._last_cpu[at], client_cpu)
        self.by_placement[(self._names[at], kind, group)].append(elapsed_s)
        self._last_cpu[at] = cpu


def percentile_rows(groups: dict[tuple[str, str, str], list[float]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for (name, kind, group), samples in sorted(groups.items()):
        ordered = sorted(samples)
        count = len(ordered)

        def at(fraction: float, ordered: list[float] = ordered, count: int = count) -> str:
            return f"{ordered[min(count - 1, int(fraction * count))] * 1e3:.3f}"

        rows.append([name, kind, group, count, at(0.5), at(0.9), at(0.99)])
    return rows


def against_baseline(observer: PlacementObserver, baseline: str) -> list[list[object]]:
    """Per service and request kind: every answer, then (for a placed service) those given on and off the
    client's CPU, whether or not the server moved; each with its share of the answers, p50, p99, and
    that p99 over the p99 of every answer `baseline` gave that kind in the same run (the score table's
    ratio, taken apart by placement). A side with no answer is left out; "-" where the baseline gave
    none."""
    sides: dict[tuple[str, str], dict[str, Latencies]] = defaultdict(lambda: defaultdict(Latencies))
    for (name, kind), every in observer.every.items():
        sides[(name, kind)]["every answer"] = every
    for (name, kind, group), samples in observer.by_placement.items():
        side = sides[(name, kind)]
        if group.endswith("on the client's"):
            side["on the client's CPU"].samples_s.extend(samples)
        elif group.endswith("off the client's"):
            side["off the client's CPU"].samples_s.extend(samples)
    rows: list[list[object]] = []
    for (name, kind), side in sorted(sides.items()):
        total = len(side["every answer"].samples_s)
        reference = observer.every.get((baseline, kind), Latencies()).percentile_ms(0.99)
        for label in ("every answer", "on the client's CPU", "off the client's CPU"):
            latencies = side.get(label)
            if latencies is None or not latencies.samples_s:
                continue
            p50, p99 = latencies.percentile_ms(0.5), latencies.percentile_ms(0.99)
            assert p50 is not None and p99 is not None
            ratio = "-" if reference is None else f"{p99 / reference:.2f}x"
            share = f"{100 * len(latencies.samples_s) / total:.0f}%"
            rows.append(
                [name, kind, label, len(latencies.samples_s), share, f"{p50:.3f}", f"{p99:.3f}", ratio]
            )
    return rows


def pin_apart(server_pids: Sequence[int]) -> Callable[[], None]:
    """Pin every thread of each server process to the last CPU this thread may run on, and this thread
    (the client) to the first, as a router on another machine would be: every server is then woken off
    its client's CPU, never on it. Returns what puts this thread's CPUs back. Threads a server starts
    later inherit its pinning."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise RuntimeError(f"--apart needs two CPUs to run on, this process may use {len(allowed)}")
    for pid in server_pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {allowed[-1]})
    os.sched_setaffinity(0, {allowed[0]})
    return lambda: os.sched_setaffinity(0, allowed)


def measure(
    spec: WorkloadSpec, passes: int, with_dynamo: bool, apart: bool = False, c_floor: bool = False
) -> PlacementObserver:
    """The idle timing of `spec`'s queries, `passes` times over, with a PlacementObserver; with `apart`,
    the client and the servers on CPUs of their own (pin_apart); with `c_floor`, the C floor in turn too,
    after the floor (with its answer)."""
    feed = build(spec, lambda message: print(message, flush=True))
    kinds = ("kvindex", "Dynamo") if with_dynamo else ("kvindex",)
    with ExitStack() as stack:
        subjects: list[Subject] = []
        for kind in kinds:
            publishers = stack.enter_context(Publishers(feed.payloads))
            subject = stack.enter_context(start_subject(kind, publishers, feed))
            ingest_first_round(
                subject, publishers, SubjectResult(kind, feed.num_blocks), ingest_timeout_s=900
            )
            subjects.append(subject)
        requests = [_requests(subject, feed, QUERY_KINDS) for subject in subjects]
        floor = _start_floor(stack, subjects, requests, lambda message: print(message, flush=True))
        floors: list[tuple[str, FloorServer]] = [] if floor is None else [(FLOOR, floor)]
        if floor is not None and c_floor:
            floors.append((C_FLOOR, stack.enter_context(CFloorServer(floor.answer))))
        names = [subject.name for subject in subjects] + [name for name, _ in floors]
        pids = [subject.pid for subject in subjects] + [server.pid for _, server in floors]
        ports = [server.port for _, server in floors]
        # Dynamo answers on a pool of threads: its placement is not one thread's.
        observer = PlacementObserver(names, pids, [name != "Dynamo" for name in names])
        if apart:
            stack.callback(pin_apart(pids))
        for _ in range(passes):
            time_queries_paired(subjects, feed, requests, ports, observer)
    return observer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.placement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a tiny workload (smoke test)")
    parser.add_argument("--passes", type=int, default=3, help="times over the queries (default 3)")
    parser.add_argument("--no-dynamo", action="store_true", help="skip Dynamo even if it is installed")
    parser.add_argument(
        "--apart", action="store_true", help="pin the client to one CPU and every server to another"
    )
    parser.add_argument(
        "--c-floor", action="store_true", help="also time the floor written in C (needs a C compiler)"
    )
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    if args.quick:
        spec = WorkloadSpec(num_engines=4, blocks_per_engine=200, num_prefixes=2, num_queries=20)
    else:
        spec = WorkloadSpec(num_engines=100, blocks_per_engine=10_000, num_prefixes=10, num_queries=200)
    with_dynamo = not args.no_dynamo and available()[0]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    if args.apart:
        print("client and servers pinned to CPUs of their own (--apart)")
    observer = measure(spec, args.passes, with_dynamo, apart=args.apart, c_floor=args.c_floor)
    headers = ["service", "request", "class", "n", "p50 ms", "p90 ms", "p99 ms"]
    print("\n== by where the server's thread answered: against its previous request's CPU and the client's")
    print(format_table(headers, percentile_rows(observer.by_placement)))
    baseline = "Dynamo" if with_dynamo else FLOOR
    print(f"\n== p99 on and off the client's CPU, against {baseline}'s p99 (every answer) in this run")
    headers = ["service", "request", "answers", "n", "share", "p50 ms", "p99 ms", f"p99 / {baseline}'s"]
    print(format_table(headers, against_baseline(observer, baseline)))
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    run_main(main, "every service, publisher and the floor were stopped")
