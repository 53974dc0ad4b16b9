"""`kvindex demo`: the whole data path in one process, on a laptop, with no GPU and no vLLM.

Per routing policy: a fresh simulated fleet (engines publishing real KV-event streams) -> the real
ingest service -> the real HTTP API; the same seeded chat trace is routed (kv-aware via POST /v1/score,
round-robin, random) to the engines over HTTP, and the engines' own cached-token counts are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvindex.cli.main import CliError
from kvindex.demo.policies import POLICY_NAMES
from kvindex.demo.report import PolicyResult, format_table
from kvindex.demo.workload import WorkloadSpec, generate_trace, shareable_token_fraction

if TYPE_CHECKING:
    from kvindex.demo.fleet import DemoOptions


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument(
        "--requests", type=int, default=1200, help="requests in the trace, per policy (default 1200)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the random policy")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=384,
        help="KV-cache blocks per engine (small, so eviction happens; default 384 = 6,144 tokens)",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop issuing new requests after this many seconds, split evenly between the policies",
    )
    parser.add_argument(
        "--index-wait-ms",
        type=float,
        default=20.0,
        help="before a kv-aware score, wait at most this long for the indexer to apply what the engines "
        "published (default 20); scores taken before that are reported as stale",
    )
    parser.add_argument(
        "--sidecars",
        action="store_true",
        help="run a kvindex sidecar beside each engine: the indexer follows the sidecars' streams and "
        "loads their snapshots",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    # The fleet (aiohttp, ZMQ, the ingest service) is imported when the demo runs, not when the CLI parses.
    from kvindex.demo import fleet as demo_fleet

    options = demo_fleet.DemoOptions(
        num_pods=args.pods,
        num_requests=args.requests,
        seed=args.seed,
        capacity_blocks=args.capacity_blocks,
        concurrency=args.concurrency,
        duration_s=args.duration,
        index_wait_ms=args.index_wait_ms,
        sidecars=args.sidecars,
    )
    trace = generate_trace(WorkloadSpec(num_requests=options.num_requests, seed=options.seed))
    block_size = demo_fleet.BLOCK_SIZE
    # A request's prompt and output must fit in one engine's cache at once.
    max_request_blocks = max(-(-(len(r.token_ids) + r.max_tokens) // block_size) for r in trace)
    if options.capacity_blocks < max_request_blocks:
        raise CliError(
            f"--capacity-blocks must be at least {max_request_blocks} to hold the longest request of "
            f"this trace"
        )
    try:
        results = asyncio.run(demo_fleet.run_all(trace, options, sys.stderr))
    except demo_fleet.DemoError as exc:
        print(f"kvindex demo: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a demo ends with one sentence, not a traceback
        print(
            f"kvindex demo: the demo stopped on an unexpected error: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    ideal = shareable_token_fraction(trace[: max(r.requests for r in results)], block_size)
    if args.json:
        print(json.dumps(_json_result(results, options, block_size, ideal), indent=2))
    else:
        print()
        print(format_table(results))
        print()
        print(_summary(results, options, block_size, ideal))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.pods < 1:
        raise CliError("--pods must be at least 1")
    if args.requests < 1:
        raise CliError("--requests must be at least 1")
    if args.capacity_blocks < 1:
        raise CliError("--capacity-blocks must be at least 1")
    if args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise CliError("--duration must be a positive number of seconds")
    if args.index_wait_ms < 0:
        raise CliError("--index-wait-ms must be >= 0")


# --- output ------------------------------------------------------------------------------------------


def _json_result(
    results: Sequence[PolicyResult], options: DemoOptions, block_size: int, ideal: float
) -> dict[str, object]:
    return {
        "pods": options.num_pods,
        "capacity_blocks": options.capacity_blocks,
        "block_size": block_size,
        "seed": options.seed,
        "concurrency": options.concurrency,
        "shareable_fraction": round(ideal, 6),
        "policies": [result.to_json() for result in results],
    }


def _summary(results: Sequence[PolicyResult], options: DemoOptions, block_size: int, ideal: float) -> str:
    by_name = {result.policy: result for result in results}
    kv_aware = by_name[POLICY_NAMES[0]]
    lines = [
        f"{options.num_pods} simulated engines x {options.capacity_blocks} blocks of {block_size} tokens; "
        f"hit rate = cached / prompt tokens, as the engines reported them "
        f"(a single unbounded cache would reach {100.0 * ideal:.1f}%).",
    ]
    if kv_aware.score_latencies_ms:
        lines.append(
            f"kv-aware: {kv_aware.stale_scores} of {len(kv_aware.score_latencies_ms)} scores were taken before "
            f"the indexer had applied every published batch (waited at most {options.index_wait_ms:g} ms)."
        )
    baseline = by_name[POLICY_NAMES[1]].prefill_tokens
    if baseline:
        saved = 1.0 - kv_aware.prefill_tokens / baseline
        lines.append(f"kv-aware computed {100.0 * saved:.0f}% fewer prefill tokens than round-robin.")
    return "\n".join(lines)
