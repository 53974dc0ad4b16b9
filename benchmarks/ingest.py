"""End-to-end ingest: EventPublishers (real ZMQ PUB + replay ROUTER on 127.0.0.1) -> IngestService -> index.

Workload: P pods x B blocks each (16-token blocks, 16 blocks per BlockStored, 8 events per message); each
pod's first 256 blocks are one of 10 shared prefixes with real vLLM sha256 hashes (so the hash check runs
and agrees), the rest are pod-unique chained keys. Reports ingest blocks/s from the first publish until
every pod's last seq is applied, against a baseline in the same run (decode_batch + KVIndex.apply of the
same payloads on one thread, no ZMQ); lookup latency p50/p99 of 512-block keys idle and during ingest;
RSS per (pod, block) entry. `python -m benchmarks.ingest [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

from kvindex.hashing import BlockHasher
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.decode import decode_batch
from kvindex.replay.publisher import EventPublisher, encode_batch
from kvindex.replay.wire import BlockStored, KVEventBatch

from benchmarks._table import format_table

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_MESSAGE = 8
NUM_PREFIXES = 10
PREFIX_BLOCKS = 256
LOOKUP_BLOCKS = 512


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_workload(
    num_pods: int, blocks_per_pod: int, seed: int = 7
) -> tuple[list[list[KVEventBatch]], list[list[int]]]:
    """Per pod: its batches, and its block keys in order (for lookups)."""
    rng = random.Random(seed)
    hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed=None)
    prefixes = []
    for _ in range(NUM_PREFIXES):
        tokens = [rng.randrange(32000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
        prefixes.append((tokens, hasher.event_hashes(tokens)))
    filler_tokens = list(range(BLOCKS_PER_EVENT * BLOCK_SIZE))  # shared object: cheap to hold
    all_batches: list[list[KVEventBatch]] = []
    all_keys: list[list[int]] = []
    for pod in range(num_pods):
        tokens, prefix_keys = prefixes[pod % NUM_PREFIXES]
        keys = list(prefix_keys[: min(PREFIX_BLOCKS, blocks_per_pod)])
        keys += [rng.getrandbits(64) for _ in range(blocks_per_pod - len(keys))]
        events = []
        for start in range(0, len(keys), BLOCKS_PER_EVENT):
            chunk = keys[start : start + BLOCKS_PER_EVENT]
            in_prefix = start + len(chunk) <= PREFIX_BLOCKS
            events.append(
                BlockStored(
                    block_hashes=chunk,
                    parent_block_hash=None if start == 0 else keys[start - 1],
                    token_ids=tokens[start * BLOCK_SIZE : (start + len(chunk)) * BLOCK_SIZE]
                    if in_prefix
                    else filler_tokens[: len(chunk) * BLOCK_SIZE],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * len(chunk),
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        batches = [
            KVEventBatch(ts=0.0, events=events[i : i + EVENTS_PER_MESSAGE], data_parallel_rank=0)
            for i in range(0, len(events), EVENTS_PER_MESSAGE)
        ]
        all_batches.append(batches)
        all_keys.append(keys)
    return all_batches, all_keys


def baseline_blocks_per_s(all_batches: list[list[KVEventBatch]], blocks: int) -> float:
    payloads = [(pod, encode_batch(b)) for pod, batches in enumerate(all_batches) for b in batches]
    index = KVIndex()
    start = time.perf_counter()
    for pod, payload in payloads:
        index.apply(PodRef(f"pod-{pod}"), decode_batch(payload).batch.events)
    return blocks / (time.perf_counter() - start)


def lookup_latencies(
    index: KVIndex, all_keys: list[list[int]], count: int, rng: random.Random
) -> list[float]:
    samples = []
    for _ in range(count):
        keys = all_keys[rng.randrange(len(all_keys))]
        probe = keys[:LOOKUP_BLOCKS]
        start = time.perf_counter()
        index.lookup(probe)
        samples.append(time.perf_counter() - start)
    return samples


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(num_pods: int, blocks_per_pod: int) -> list[list[object]]:
    all_batches, all_keys = build_workload(num_pods, blocks_per_pod)
    total_blocks = num_pods * blocks_per_pod
    baseline = baseline_blocks_per_s(all_batches, total_blocks)

    publishers = [
        EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for _ in range(num_pods)
    ]
    pods = [
        PodConfig(f"pod-{i}", p.endpoint, "m", replay_endpoint=p.replay_endpoint)
        for i, p in enumerate(publishers)
    ]
    service = IngestService([ModelConfig(name="m")], pods, settings=IngestSettings())
    rss_before = rss_bytes()
    service.start()
    try:
        deadline = time.monotonic() + 60
        while not (service.ready() and all(s.state != "disconnected" for s in service.pod_statuses())):
            if time.monotonic() > deadline:
                raise SystemExit("indexer did not connect to every publisher within 60 s")
            time.sleep(0.05)
        index = service.model("m").index  # type: ignore[union-attr]
        last_seqs = {f"pod-{i}": len(b) - 1 for i, b in enumerate(all_batches)}
        busy_samples: list[float] = []
        done = threading.Event()

        def sample_during_ingest() -> None:
            rng = random.Random(1)
            while not done.is_set():
                busy_samples.extend(lookup_latencies(index, all_keys, 20, rng))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample_during_ingest, daemon=True)
        start = time.perf_counter()
        sampler.start()
        num_messages = max(len(b) for b in all_batches)
        for m in range(num_messages):  # interleaved, as a fleet would publish
            for pod, batches in enumerate(all_batches):
                if m < len(batches):
                    publishers[pod].publish_batch(batches[m])
        while True:
            statuses = {s.pod: s.last_seq for s in service.pod_statuses()}
            if all(statuses.get(pod) == seq for pod, seq in last_seqs.items()):
                break
            if time.perf_counter() - start > 600:
                raise SystemExit("ingest did not finish within 600 s")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
        done.set()
        sampler.join()
        idle_samples = lookup_latencies(index, all_keys, 2000, random.Random(2))
        entries = index.num_entries()
        rss_per_entry = (rss_bytes() - rss_before) / max(1, entries)
        counters = service.counters()
    finally:
        service.stop()
        for publisher in publishers:
            publisher.close()
    us = 1e6
    return [
        ["ingest end to end (ZMQ)", f"{total_blocks / elapsed:,.0f} blocks/s", f"{elapsed:.2f} s"],
        ["baseline decode+apply, 1 thread", f"{baseline:,.0f} blocks/s", "same payloads, no ZMQ"],
        [
            "lookup 512 blocks, idle",
            f"p50 {percentile(idle_samples, 0.5) * us:.0f} us",
            f"p99 {percentile(idle_samples, 0.99) * us:.0f} us",
        ],
        [
            "lookup 512 blocks, during ingest",
            f"p50 {percentile(busy_samples, 0.5) * us:.0f} us",
            f"p99 {percentile(busy_samples, 0.99) * us:.0f} us (n={len(busy_samples)})",
        ],
        ["RSS per (pod, block) entry", f"{rss_per_entry:.0f} B", f"{entries:,} entries"],
        [
            "gaps / replays / hash mismatches",
            f"{counters.gaps} / {sum(counters.replays.values())} / {counters.hash_mismatches}",
            f"dropped {counters.dropped}",
        ],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 pods x 1,000 blocks (smoke test)")
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=10_000, help="blocks per pod")
    args = parser.parse_args(argv)
    num_pods, blocks = (10, 1_000) if args.quick else (args.pods, args.blocks)
    rows = run(num_pods, blocks)
    print(
        f"ingest: {num_pods} pods x {blocks:,} blocks, {BLOCKS_PER_EVENT} blocks/event, {EVENTS_PER_MESSAGE} events/message"
    )
    print(format_table(["measure", "value", "detail"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
