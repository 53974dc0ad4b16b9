"""Wire-decode and publisher throughput, against a plain msgspec decode of the same bytes in the same run.

Batches are shaped like a busy vLLM engine step: 8 BlockStored events of 16 blocks each (256 token ids,
`extra_keys` [nil]*16, group 0, full_attention), encoded exactly as vLLM encodes them. Rows:
  msgpack.decode (baseline)  schema-less msgspec decode to Python objects: the floor for any decoder
  typed wire decode          the fast path's msgspec Decoder(KVEventBatch) alone, no conversion
  decode_batch               kvindex's decode + conversion to domain events (the ingest path)
  ..., token ids skipped     the same with with_token_ids=False (token ids left undecoded)
  decode_batch, per-event    the fallback path (the same batch plus one unknown event)
  publisher                  EventPublisher.publish + flush, PUB -> SUB on 127.0.0.1 (messages/s)
`python -m benchmarks.decode [--quick]`.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from functools import partial

import msgspec
import zmq
from kvindex.indexer.decode import decode_batch
from kvindex.replay import wire
from kvindex.replay.publisher import EventPublisher, encode_batch

BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 8
BLOCK_SIZE = 16
NUM_BATCHES = 256


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """Columns as wide as their widest cell, numbers right-aligned."""
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric, strict=True))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in [lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def make_batches(rng: random.Random, num_batches: int) -> list[wire.KVEventBatch]:
    batches = []
    for step in range(num_batches):
        events: list[wire.WireEvent] = []
        for _ in range(EVENTS_PER_BATCH):
            events.append(
                wire.BlockStored(
                    block_hashes=[rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)],
                    parent_block_hash=rng.getrandbits(64),
                    token_ids=[rng.randrange(150_001) for _ in range(BLOCKS_PER_EVENT * BLOCK_SIZE)],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * BLOCKS_PER_EVENT,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        batches.append(wire.KVEventBatch(ts=1.7e9 + step, events=events, data_parallel_rank=0))
    return batches


def best_rate(run: Callable[[], int], repeats: int) -> float:
    """Units per second of the fastest of `repeats` runs (`run` returns the units it processed)."""
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        units = run()
        elapsed = time.perf_counter() - started
        best = max(best, units / elapsed)
    return best


def decode_rates(
    payloads: list[bytes], fallback_payloads: list[bytes], rounds: int, repeats: int
) -> list[list[object]]:
    blocks_per_batch = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    typed = msgspec.msgpack.Decoder(wire.KVEventBatch)
    plain = msgspec.msgpack.Decoder()

    def loop(decode: Callable[[bytes], object], batches: list[bytes]) -> Callable[[], int]:
        def run() -> int:
            for _ in range(rounds):
                for payload in batches:
                    decode(payload)
            return rounds * len(batches) * blocks_per_batch

        return run

    baseline = best_rate(loop(plain.decode, payloads), repeats)
    rows: list[list[object]] = []
    for name, decode, batches in (
        ("msgpack.decode (baseline)", plain.decode, payloads),
        ("typed wire decode", typed.decode, payloads),
        ("decode_batch", decode_batch, payloads),
        ("decode_batch, token ids skipped", partial(decode_batch, with_token_ids=False), payloads),
        ("decode_batch, per-event", decode_batch, fallback_payloads),
    ):
        rate = baseline if name.endswith("(baseline)") else best_rate(loop(decode, batches), repeats)
        rows.append(
            [name, "block-events/s", round(rate), round(rate / blocks_per_batch), f"{rate / baseline:.2f}x"]
        )
    return rows


def publisher_rate(batches: list[wire.KVEventBatch], rounds: int) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    received = 0
    total = rounds * len(batches)
    try:
        publisher = EventPublisher("tcp://127.0.0.1:*", ctx=ctx, max_queue_size=total + 1)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(b"")
        sub.connect(publisher.endpoint)
        stop = threading.Event()

        def drain() -> None:
            nonlocal received
            while not stop.is_set():
                if sub.poll(50, zmq.POLLIN):
                    sub.recv_multipart(zmq.NOBLOCK)
                    received += 1

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        started = time.perf_counter()
        for _ in range(rounds):
            for batch in batches:
                publisher.publish_batch(batch)
        publisher.flush(60.0)
        elapsed = time.perf_counter() - started
        stop.set()
        drainer.join(5.0)
        sub.close(linger=0)
        publisher.close()
        return publisher.sent_count / elapsed
    finally:
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds only (smoke test)")
    args = parser.parse_args(argv)
    rounds, repeats = (1, 1) if args.quick else (8, 3)
    batches = make_batches(random.Random(0), 16 if args.quick else NUM_BATCHES)
    payloads = [encode_batch(batch) for batch in batches]
    unknown_event = msgspec.msgpack.encode({"type": "BlockFrobbed"})
    fallback_payloads = [
        msgspec.msgpack.encode(
            [
                b.ts,
                [*(msgspec.Raw(encode_event) for encode_event in _raw_events(b)), msgspec.Raw(unknown_event)],
                0,
            ]
        )
        for b in batches
    ]
    rows = decode_rates(payloads, fallback_payloads, rounds, repeats)
    pub_rate = publisher_rate(batches, rounds=1 if args.quick else 8)
    rows.append(["publisher (PUB->SUB)", "messages/s", round(pub_rate), round(pub_rate), "-"])
    print(
        f"batches of {EVENTS_PER_BATCH} BlockStored x {BLOCKS_PER_EVENT} blocks, "
        f"{sum(map(len, payloads)) // len(payloads)} bytes each"
    )
    print(format_table(["path", "unit", "rate", "batches/s", "vs baseline"], rows))
    return 0


def _raw_events(batch: wire.KVEventBatch) -> list[bytes]:
    return [msgspec.msgpack.encode(event) for event in batch.events]


if __name__ == "__main__":
    raise SystemExit(main())
