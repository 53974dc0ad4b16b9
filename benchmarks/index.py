"""Benchmark of the block index alone (no ZMQ, no decoding): apply throughput, lookup/score latency, memory.

Workload: N pods each store ~B blocks as 16-block BlocksStored events (one event per batch): sequences of
one of 10 shared 256-block prefixes (stored only the first time a pod uses it) followed by 256 blocks of
its own. Prompts are 512-block sequences a pod stored. A plain dict-of-sets index (no LRU, locks or
reverse map) applies the same events in the same run, as the floor of what Python can do.

    python -m benchmarks.index [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvindex.indexer.events import BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.scorer import score_prefix

from benchmarks._table import format_table

Batch = tuple[PodRef, list[BlocksStored]]


@dataclass(frozen=True)
class Workload:
    batches: list[Batch]
    prompts: list[list[int]]
    num_blocks: int


def build_workload(num_pods: int, blocks_per_pod: int, prefix_blocks: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(64) for _ in range(prefix_blocks)] for _ in range(10)]
    batches: list[Batch] = []
    prompts: list[list[int]] = []
    for pod_no in range(num_pods):
        pod = PodRef(f"pod-{pod_no}")
        held_prefixes: set[int] = set()
        stored = 0
        while stored < blocks_per_pod:
            prefix_no = rng.randrange(10)
            suffix = [rng.getrandbits(64) for _ in range(prefix_blocks)]
            chain = prefixes[prefix_no] + suffix
            prompts.append(chain)
            first = prefix_blocks if prefix_no in held_prefixes else 0
            held_prefixes.add(prefix_no)
            to_store = chain[first : first + blocks_per_pod - stored]
            parent = chain[first - 1] if first else None
            for start in range(0, len(to_store), 16):
                keys = tuple(to_store[start : start + 16])
                batches.append(
                    (pod, [BlocksStored(block_keys=keys, parent_key=parent, token_ids=(), block_size=16)])
                )
                parent = keys[-1]
            stored += len(to_store)
    rng.shuffle(prompts)
    return Workload(batches, prompts, sum(len(b[1][0].block_keys) for b in batches))


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


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def time_apply(
    make: Callable[[], KVIndex | DictOfSetsIndex], workload: Workload
) -> tuple[float, int, object]:
    """Blocks/s of applying every batch, and the RSS the index grew by."""
    gc.collect()
    rss_before = rss_bytes()
    index = make()
    apply = index.apply
    started = time.perf_counter()
    for pod, events in workload.batches:
        apply(pod, events)
    elapsed = time.perf_counter() - started
    return workload.num_blocks / elapsed, rss_bytes() - rss_before, index


def traced_bytes(make: Callable[[], KVIndex | DictOfSetsIndex], workload: Workload) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        index = make()
        for pod, events in workload.batches:
            index.apply(pod, events)
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def time_reads(index: KVIndex, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    results = {}
    readers: dict[str, Callable[[list[int]], object]] = {
        "lookup_ids": index.lookup_ids,
        "lookup": index.lookup,
        "score_prefix": lambda prompt: score_prefix(index, prompt, block_size=16),
    }
    for name, read in readers.items():
        samples = []
        for prompt in prompts:
            started = time.perf_counter()
            read(prompt)
            samples.append(time.perf_counter() - started)
        results[name] = percentiles(samples)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.index", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 pods x 1000 blocks, for a smoke test")
    args = parser.parse_args(argv)
    num_pods, blocks_per_pod, prefix_blocks = (10, 1000, 64) if args.quick else (100, 10_000, 256)
    workload = build_workload(num_pods, blocks_per_pod, prefix_blocks)
    prompts = workload.prompts[: 50 if args.quick else 1000]
    print(
        f"index: {num_pods} pods x {blocks_per_pod} blocks, {len(workload.batches)} batches of 16 blocks, "
        f"10 shared {prefix_blocks}-block prefixes, {len(prompts)} prompts of {2 * prefix_blocks} blocks"
    )

    makers: dict[str, Callable[[], KVIndex | DictOfSetsIndex]] = {
        "dict-of-sets (baseline)": DictOfSetsIndex,
        "KVIndex 1 shard": lambda: KVIndex(num_shards=1),
        "KVIndex 16 shards": lambda: KVIndex(num_shards=16),
    }
    rows: list[list[object]] = []
    read_rows: list[list[object]] = []
    for name, make in makers.items():
        blocks_per_s, rss_growth, index = time_apply(make, workload)
        num_entries = workload.num_blocks if isinstance(index, DictOfSetsIndex) else index.num_entries()
        traced = traced_bytes(make, workload)
        rows.append(
            [
                name,
                f"{blocks_per_s:,.0f}",
                num_entries,
                f"{traced / num_entries:.0f}",
                f"{rss_growth / num_entries:.0f}",
            ]
        )
        if isinstance(index, KVIndex):
            for reader, (p50, p99) in time_reads(index, prompts).items():
                read_rows.append([name, reader, f"{p50 * 1e3:.3f}", f"{p99 * 1e3:.3f}"])
        del index
    print(format_table(["index", "apply blocks/s", "entries", "traced B/entry", "RSS B/entry"], rows))
    print(
        "(RSS growth is only meaningful on the first row: later indexes reuse memory freed by earlier ones)"
    )
    print()
    print(format_table(["index", "read", "p50 ms", "p99 ms"], read_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
