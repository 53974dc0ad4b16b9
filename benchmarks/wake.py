"""Where the scheduler wakes a server, by how long it works per request: why the floor's own answers are
not the floor a working server meets.

`python -m benchmarks.wake [--requests N] [--work-us 0,5,80,280]` starts one floor server per work level
(benchmarks/floor.py with WORK_US: the CPU kept busy that long before each answer, as computing one would),
asks them in turn through one TimedClient each (the score rows' client, the first to ask swapping every
round), and after each answer reads from /proc whether the server's thread ran on the client's CPU. Prints,
per work level, the share of answers given there and the latency percentiles.

On this two-vCPU guest the server that does no work answers on its client's CPU nearly always (the
client's write wakes it there, and it is done before the client needs the CPU again), at a p50 of 0.03-0.04
ms. Servers that compute answer there far less often (0-59% of the time, for 5 to 280 us of work), and the
rest of their answers pay a cross-CPU wake-up of a halted vCPU. Each of their answers then costs 0.08-0.13
ms at p50 beyond the work itself. kvindex and Dynamo both do a score's work, so the floor's on-CPU answers
(benchmarks/placement.py) are a path they mostly do not take.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from benchmarks._process import run_main
from benchmarks._table import format_table
from benchmarks.compare import Latencies
from benchmarks.floor import FloorServer
from benchmarks.placement import thread_cpu
from benchmarks.service import TimedClient

DEFAULT_WORK_US = (0.0, 5.0, 80.0, 280.0)
PATH = "/v1/score"


def request_body(num_hashes: int = 512, seed: int = 0) -> bytes:
    """A 512-hash score body (the servers do not read it; its size is the score row's)."""
    rng = random.Random(seed)
    return json.dumps(
        {"model": "bench", "block_hashes": [rng.getrandbits(63) for _ in range(num_hashes)]}
    ).encode()


@dataclass
class WakeRow(Latencies):
    """One work level's timed answers, and how many its server gave on the client's CPU."""

    work_us: float = 0.0
    on_client_cpu: int = 0

    def share_on_client_cpu(self) -> float:
        return self.on_client_cpu / len(self.samples_s) if self.samples_s else 0.0


def sweep(work_levels_us: Sequence[float], requests: int, body: bytes | None = None) -> list[WakeRow]:
    """`requests` timed answers from each of one floor server per work level, asked in turn."""
    body = request_body() if body is None else body
    rows = [WakeRow(work_us=work_us) for work_us in work_levels_us]
    with ExitStack() as stack:
        servers = [stack.enter_context(FloorServer(b"{}", work_us=work_us)) for work_us in work_levels_us]
        clients = [TimedClient(server.port) for server in servers]
        for client in clients:
            stack.callback(client.close)
            for _ in range(3):  # untimed warm-up
                client.post(PATH, body)
        client_tid = threading.get_native_id()
        order = list(range(len(servers)))
        gc_was_enabled = gc.isenabled()
        gc.disable()  # as the score rows time
        try:
            for index in range(requests):
                for at in order if index % 2 == 0 else reversed(order):
                    elapsed, _ = clients[at].post(PATH, body)
                    pid = servers[at].pid
                    rows[at].samples_s.append(elapsed)
                    rows[at].on_client_cpu += thread_cpu(pid, pid) == thread_cpu(os.getpid(), client_tid)
        finally:
            if gc_was_enabled:
                gc.enable()
    return rows


def _work_levels(text: str) -> list[float]:
    levels = [float(part) for part in text.split(",") if part.strip()]
    if not levels or any(level < 0 for level in levels):
        raise argparse.ArgumentTypeError(f"expected comma-separated work levels >= 0 in us, got {text!r}")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wake", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="timed answers per server (default 5000)")
    parser.add_argument(
        "--work-us",
        type=_work_levels,
        default=list(DEFAULT_WORK_US),
        help="comma-separated busy time per answer, one server each (default 0,5,80,280)",
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    rows = sweep(args.work_us, args.requests)
    headers = ["work per answer us", "answers", "on the client's CPU", "p50 ms", "p90 ms", "p99 ms"]
    table = [
        [
            f"{row.work_us:g}",
            len(row.samples_s),
            f"{row.share_on_client_cpu():.0%}",
            *(f"{row.percentile_ms(fraction) or 0.0:.3f}" for fraction in (0.5, 0.9, 0.99)),
        ]
        for row in rows
    ]
    print("\n== where a server's thread answered, by its work per answer (floor servers asked in turn)")
    print(format_table(headers, table))
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    run_main(main, "every floor server was stopped")
