"""Benchmark of the block index alone (no ZMQ, no decoding): apply throughput, lookup/score latency, memory.

Workload: N pods each store ~B blocks as 16-block BlocksStored events, 8 events per batch: sequences of one
of 10 shared P-block prefixes (stored only the first time a pod uses it) followed by P blocks of its own.
Prompts are 2P-block sequences a pod stored. A plain dict-of-sets index (no LRU, locks, copies or reverse
map) applies the same batches in the same run, as the floor of what Python can do.

Each index runs in a fresh subprocess, so no row reuses memory another freed. Bytes per (pod, block) pair
are the RSS growth of applying a workload generated on the fly: the index owns its block keys, as it does
in the service (a pre-built workload would share them and hide ~36 B per key).

    python -m benchmarks.index [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvindex.indexer import compiled
from kvindex.indexer.events import BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.scorer import score_prefix

from benchmarks._table import format_table

Batch = tuple[PodRef, list[BlocksStored]]
EVENT_BLOCKS = 16
BATCH_EVENTS = 8
INDEXES = (
    "dict-of-sets (baseline)",
    "KVIndex 1 shard",
    "KVIndex 4 shards",
    "KVIndex 1 shard, pure",
    "KVIndex 4 shards, pure",
)


@dataclass(frozen=True)
class Workload:
    batches: list[Batch]
    prompts: list[list[int]]
    num_blocks: int


def iter_batches(
    num_pods: int, blocks_per_pod: int, prefix_blocks: int, prompts: list[list[int]] | None = None
) -> Iterator[Batch]:
    """The workload's batches in order, built as they are consumed (seeded: always the same)."""
    rng = random.Random(0)
    prefixes = [[rng.getrandbits(64) for _ in range(prefix_blocks)] for _ in range(10)]
    for pod_no in range(num_pods):
        pod = PodRef(f"pod-{pod_no}")
        held_prefixes: set[int] = set()
        events: list[BlocksStored] = []
        stored = 0
        while stored < blocks_per_pod:
            prefix_no = rng.randrange(10)
            chain = prefixes[prefix_no] + [rng.getrandbits(64) for _ in range(prefix_blocks)]
            if prompts is not None:
                prompts.append(chain)
            first = prefix_blocks if prefix_no in held_prefixes else 0
            held_prefixes.add(prefix_no)
            to_store = chain[first : first + blocks_per_pod - stored]
            parent = chain[first - 1] if first else None
            for start in range(0, len(to_store), EVENT_BLOCKS):
                keys = tuple(to_store[start : start + EVENT_BLOCKS])
                events.append(BlocksStored(block_keys=keys, parent_key=parent, token_ids=(), block_size=16))
                parent = keys[-1]
                if len(events) == BATCH_EVENTS:
                    yield pod, events
                    events = []
            stored += len(to_store)
        if events:
            yield pod, events


def build_workload(num_pods: int, blocks_per_pod: int, prefix_blocks: int) -> Workload:
    prompts: list[list[int]] = []
    batches = list(iter_batches(num_pods, blocks_per_pod, prefix_blocks, prompts))
    random.Random(1).shuffle(prompts)
    num_blocks = sum(len(event.block_keys) for _, events in batches for event in events)
    return Workload(batches, prompts, num_blocks)


class DictOfSetsIndex:
    """The baseline: key -> set of (pod, tier), nothing else."""

    def __init__(self) -> None:
        self.holders: dict[int, set[tuple[PodRef, str]]] = {}

    def apply(self, pod: PodRef, events: Sequence[BlocksStored]) -> None:
        holders = self.holders
        for event in events:
            entry = (pod, event.tier)
            for key in event.block_keys:
                found = holders.get(key)
                if found is None:
                    holders[key] = {entry}
                else:
                    found.add(entry)

    def lookup(self, block_keys: Sequence[int]) -> list[tuple[tuple[PodRef, str], ...]]:
        result = []
        for key in block_keys:
            found = self.holders.get(key)
            if not found:
                break
            result.append(tuple(found))
        return result

    def num_entries(self) -> int:
        return sum(len(found) for found in self.holders.values())


def make_index(name: str) -> KVIndex | DictOfSetsIndex:
    if name == INDEXES[0]:
        return DictOfSetsIndex()
    # ", pure" rows run in a process started with KVINDEX_PURE_PYTHON=1 (see main): shard.py's core.
    return KVIndex(num_shards=int(name.split()[1]))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def time_reads(index: KVIndex | DictOfSetsIndex, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    readers: dict[str, Callable[[list[int]], object]] = {"lookup": index.lookup}
    if isinstance(index, KVIndex):
        readers["lookup_ids"] = index.lookup_ids
        readers["score_prefix"] = lambda prompt: score_prefix(index, prompt, block_size=16)
    results = {}
    for name, read in readers.items():
        samples = []
        for prompt in prompts:
            started = time.perf_counter()
            read(prompt)
            samples.append(time.perf_counter() - started)
        results[name] = percentiles(samples)
    return results


def measure(name: str, num_pods: int, blocks_per_pod: int, prefix_blocks: int, num_prompts: int) -> dict:
    """One index, in this (fresh) process: RSS per pair, then apply throughput and read latency."""
    gc.collect()
    rss_before = rss_bytes()
    index = make_index(name)
    for pod, events in iter_batches(num_pods, blocks_per_pod, prefix_blocks):
        index.apply(pod, events)
    gc.collect()
    num_pairs = index.num_entries()
    bytes_per_pair = (rss_bytes() - rss_before) / num_pairs
    del index

    workload = build_workload(num_pods, blocks_per_pod, prefix_blocks)
    index = make_index(name)
    apply = index.apply
    started = time.perf_counter()
    for pod, events in workload.batches:
        apply(pod, events)
    blocks_per_s = workload.num_blocks / (time.perf_counter() - started)
    reads = time_reads(index, workload.prompts[:num_prompts])
    return {
        "blocks_per_s": blocks_per_s,
        "pairs": num_pairs,
        "bytes_per_pair": bytes_per_pair,
        "batches": len(workload.batches),
        "reads": reads,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.index", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 pods x 1000 blocks, for a smoke test")
    parser.add_argument("--worker", choices=INDEXES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    num_pods, blocks_per_pod, prefix_blocks = (10, 1000, 64) if args.quick else (100, 10_000, 256)
    num_prompts = 50 if args.quick else 1000
    if args.worker:
        print(json.dumps(measure(args.worker, num_pods, blocks_per_pod, prefix_blocks, num_prompts)))
        return 0

    results = {}
    for name in INDEXES:
        command = [sys.executable, "-m", "benchmarks.index", "--worker", name] + (
            ["--quick"] if args.quick else []
        )
        env = {k: v for k, v in os.environ.items() if k != "KVINDEX_PURE_PYTHON"}
        if name.endswith(", pure"):
            env["KVINDEX_PURE_PYTHON"] = "1"
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            print(f"{name} failed:\n{done.stderr}", file=sys.stderr)
            return 1
        results[name] = json.loads(done.stdout)
    first = results[INDEXES[0]]
    print(
        f"index: {num_pods} pods x {blocks_per_pod} blocks, {first['batches']} batches of {BATCH_EVENTS} "
        f"{EVENT_BLOCKS}-block events, 10 shared {prefix_blocks}-block prefixes, {num_prompts} prompts of "
        f"{2 * prefix_blocks} blocks"
    )
    rows = [
        [name, f"{r['blocks_per_s']:,.0f}", r["pairs"], f"{r['bytes_per_pair']:.0f}"]
        for name, r in results.items()
    ]
    print(format_table(["index", "apply blocks/s", "pairs", "RSS B/pair"], rows))
    print(f"(KVIndex rows run the {compiled.describe()[len('block index: ') :]}; ', pure' rows shard.py's)")
    print("(RSS growth per (pod, block) pair, each index in a fresh process, block keys owned by the index)")
    print()
    read_rows = [
        [name, reader, f"{p50 * 1e3:.3f}", f"{p99 * 1e3:.3f}"]
        for name, r in results.items()
        for reader, (p50, p99) in r["reads"].items()
    ]
    print(format_table(["index", "read", "p50 ms", "p99 ms"], read_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
