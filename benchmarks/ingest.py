"""End-to-end ingest: engines (real ZMQ PUB sockets on 127.0.0.1) -> IngestService -> index.

The engines run in a forked process and publish pre-encoded payloads from one thread with no replay
ring, exactly as benchmarks.dynamo feeds Dynamo, so this process measures only the indexer's own work. Workload: P pods x B blocks each (16-token blocks, 16 blocks per BlockStored, 8 events per message); each
pod's first 256 blocks are one of 10 shared prefixes with real vLLM sha256 hashes (so the hash check runs
and agrees), the rest are pod-unique chained keys. Reports ingest blocks/s from the first publish until
every pod's last seq is applied, against a baseline in the same run (decode_batch + KVIndex.apply of the
same payloads on one thread, no ZMQ); lookup latency p50/p99 of 512-block keys idle and during ingest;
RSS per (pod, block) entry. `python -m benchmarks.ingest [--quick]`.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import multiprocessing.connection
import os
import random
import threading
import time

import zmq
from kvindex.cli.process import heap_releaser
from kvindex.hashing import BlockHasher
from kvindex.indexer.decode import decode_batch
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import BlockStored, KVEventBatch

from benchmarks._table import format_table

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_MESSAGE = 8
NUM_PREFIXES = 10
PREFIX_BLOCKS = 256
LOOKUP_BLOCKS = 512
LOOKUP_INTERVAL_S = 0.005


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


def _publisher_process(payloads: list[list[bytes]], conn: multiprocessing.connection.Connection) -> None:
    """The engines, in their own process and as lean as the Dynamo benchmark's: one XPUB per pod (a PUB on
    the wire that also says when our SUB has subscribed), vLLM's live frames `[topic, seq, payload]`
    from pre-encoded payloads, no replay ring (the indexer is told there is none). Reports the
    endpoints, "subscribed" once every SUB is attached, publishes everything interleaved (as a fleet
    would) on "go", reports "published", and keeps the sockets open until "close"."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = [ctx.socket(zmq.XPUB) for _ in payloads]
    try:
        for sock in sockets:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVTIMEO, 60_000)
            sock.bind("tcp://127.0.0.1:0")
        conn.send([sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in sockets])
        for sock in sockets:
            sock.recv()  # the subscription: the SUB is attached, nothing published from now on is lost
        conn.send("subscribed")
        if conn.recv() != "go":
            return
        for seq in range(max(len(p) for p in payloads)):
            seq_frame = seq.to_bytes(8, "big")
            for sock, pod_payloads in zip(sockets, payloads, strict=True):
                if seq < len(pod_payloads):
                    sock.send_multipart([b"", seq_frame, pod_payloads[seq]])
        conn.send("published")
        conn.recv()  # "close"
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def run(num_pods: int, blocks_per_pod: int, num_workers: int | None = None) -> list[list[object]]:
    all_batches, all_keys = build_workload(num_pods, blocks_per_pod)
    total_blocks = num_pods * blocks_per_pod
    baseline = baseline_blocks_per_s(all_batches, total_blocks)

    # Fork before this process opens any ZMQ context; the publishers' CPU is then not ours.
    payloads = [[encode_batch(batch) for batch in batches] for batches in all_batches]
    last_seqs = {PodRef(f"pod-{i}"): len(b) - 1 for i, b in enumerate(all_batches)}
    # The decoded workload is millions of GC-tracked objects an indexer would not hold: let it go, so
    # the collector's full passes during ingest walk the indexer's own heap only.
    del all_batches
    gc.collect()
    mp = multiprocessing.get_context("fork")
    conn, child_conn = mp.Pipe()
    engines = mp.Process(target=_publisher_process, args=(payloads, child_conn), daemon=True)
    engines.start()
    if not conn.poll(60):
        raise SystemExit("the publisher process did not start within 60 s")
    endpoints: list[str] = conn.recv()
    pods = [
        PodConfig(f"pod-{i}", endpoint, "m", replay_endpoint=None) for i, endpoint in enumerate(endpoints)
    ]
    settings = IngestSettings() if num_workers is None else IngestSettings(num_workers=num_workers)
    # As `kvindex serve` runs it: freed payload pages are handed back after bursts.
    service = IngestService([ModelConfig(name="m")], pods, settings=settings, release_heap=heap_releaser())
    rss_before = rss_bytes()
    service.start()
    try:
        if not conn.poll(60) or conn.recv() != "subscribed":
            raise SystemExit("the indexer did not subscribe to every publisher within 60 s")
        deadline = time.monotonic() + 60
        while not service.ready():
            if time.monotonic() > deadline:
                raise SystemExit("indexer did not join every publisher within 60 s")
            time.sleep(0.05)
        index = service.model("m").index  # type: ignore[union-attr]
        busy_samples: list[float] = []
        done = threading.Event()

        def sample_during_ingest() -> None:
            # Paced like a router's request stream (~200 lookups/s): a closed loop would take half the
            # GIL and measure itself rather than the ingest.
            rng = random.Random(1)
            while not done.is_set():
                busy_samples.extend(lookup_latencies(index, all_keys, 1, rng))
                time.sleep(LOOKUP_INTERVAL_S)

        sampler = threading.Thread(target=sample_during_ingest, daemon=True)
        sampler.start()
        start = time.perf_counter()
        cpu_start = time.process_time()
        conn.send("go")
        published_at = float("nan")
        while service.applied_seqs() != last_seqs:
            if time.perf_counter() - start > 600:
                raise SystemExit("ingest did not finish within 600 s")
            time.sleep(0.01)
            if published_at != published_at and conn.poll():
                conn.recv()  # "published": the engines have sent everything
                published_at = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        done.set()
        sampler.join()
        idle_samples = lookup_latencies(index, all_keys, 2000, random.Random(2))
        entries = index.num_entries()
        rss_per_entry = (rss_bytes() - rss_before) / max(1, entries)
        counters = service.counters()
    finally:
        service.stop()
        if published_at != published_at:
            conn.recv()
        conn.send("close")
        engines.join(10)
    us = 1e6
    return [
        [
            "ingest end to end (ZMQ)",
            f"{total_blocks / elapsed:,.0f} blocks/s",
            f"{elapsed:.2f} s (publishers done at {published_at:.2f} s)",
        ],
        # CPU seconds of this whole process (ZMQ IO threads and the lookup sampler included): the figure
        # that holds on a machine shared with other work, where wall time does not.
        ["ingest per indexer CPU-second", f"{total_blocks / cpu:,.0f} blocks/s", f"{cpu:.2f} CPU s"],
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
    parser.add_argument("--workers", type=int, default=None, help="ingest worker threads (default: settings)")
    args = parser.parse_args(argv)
    num_pods, blocks = (10, 1_000) if args.quick else (args.pods, args.blocks)
    rows = run(num_pods, blocks, args.workers)
    print(
        f"ingest: {num_pods} pods x {blocks:,} blocks, {BLOCKS_PER_EVENT} blocks/event, {EVENTS_PER_MESSAGE} events/message"
    )
    print(format_table(["measure", "value", "detail"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
