"""Score latency over HTTP: POST /v1/score for 8192-token prompts against a full index.

Setup: 100 pods x 10,000 blocks (block size 16, sha256) filled straight into the model's KVIndex with
`apply`, the real aiohttp app on 127.0.0.1 (server on a thread of this process; one keep-alive client in
a separate process sending requests one at a time). Request kinds:
  tokens/warm   token_ids of prompts the hasher memo has seen (a router re-scoring a conversation);
  tokens/fresh  a known 4096-token prefix + 4096 new tokens every request (half the blocks hashed cold);
  hashes        block_hashes (event form) of a known prompt: no hashing at all.
Each is measured idle and while a thread applies store/remove events to the index as fast as it can.
Baseline, same run: the same work as a direct function call (hash + score_prefix), without HTTP.
`python -m benchmarks.score [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import aiohttp
import msgspec
from kvindex.cli.config import ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import BlocksRemoved, BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.scorer import score_prefix

from benchmarks._table import format_table

BLOCK_SIZE = 16
PROMPT_TOKENS = 8192
VOCAB = 150_001
MODEL = ModelConfig(name="bench", block_size=BLOCK_SIZE, hash_algo="sha256", hash_seed="0")


class Corpus:
    """Documents of PROMPT_TOKENS tokens; groups of ten share a 4096-token system prompt."""

    def __init__(self, rng: random.Random, num_docs: int) -> None:
        hasher = BlockHasher(algo=MODEL.hash_algo, block_size=BLOCK_SIZE, seed=MODEL.hash_seed)
        half = PROMPT_TOKENS // 2
        systems = [[rng.randrange(VOCAB) for _ in range(half)] for _ in range((num_docs + 9) // 10)]
        self.docs = [systems[i // 10] + [rng.randrange(VOCAB) for _ in range(half)] for i in range(num_docs)]
        self.keys = [hasher.event_hashes(doc) for doc in self.docs]


def fill_index(index: KVIndex, corpus: Corpus, rng: random.Random, num_pods: int, blocks_per_pod: int) -> int:
    """Each pod stores prefixes of random documents until it holds `blocks_per_pod` distinct blocks."""
    num_entries = 0
    for pod_number in range(num_pods):
        pod = PodRef(pod_id=f"pod-{pod_number:03d}")
        held: set[int] = set()
        while len(held) < blocks_per_pod:
            doc = rng.randrange(len(corpus.docs))
            keys = corpus.keys[doc]
            length = min(rng.randrange(len(keys) // 4, len(keys) + 1), len(keys))
            new = [k for k in keys[:length] if k not in held][: blocks_per_pod - len(held)]
            if not new:
                continue
            start = keys.index(new[0])
            stop = start + len(new)
            event = BlocksStored(
                block_keys=tuple(keys[start:stop]),
                parent_key=keys[start - 1] if start else None,
                token_ids=tuple(corpus.docs[doc][start * BLOCK_SIZE : stop * BLOCK_SIZE]),
                block_size=BLOCK_SIZE,
            )
            index.apply(pod, [event])
            held.update(keys[start:stop])
        num_entries += len(held)
    return num_entries


class Churn:
    """A thread storing and removing blocks of random pods as fast as it can (the ingest path)."""

    def __init__(self, index: KVIndex, corpus: Corpus, num_pods: int) -> None:
        self._index = index
        self._corpus = corpus
        self._num_pods = num_pods
        self._stop = threading.Event()
        self.num_events = 0
        self._thread = threading.Thread(target=self._run, name="bench-churn", daemon=True)

    def __enter__(self) -> Churn:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.started

    def _run(self) -> None:
        rng = random.Random(7)
        while not self._stop.is_set():
            pod = PodRef(pod_id=f"pod-{rng.randrange(self._num_pods):03d}")
            doc = rng.randrange(len(self._corpus.docs))
            keys = self._corpus.keys[doc]
            start = rng.randrange(len(keys) - 16)
            batch = tuple(keys[start : start + 16])
            stored = BlocksStored(
                block_keys=batch,
                parent_key=keys[start - 1] if start else None,
                token_ids=tuple(self._corpus.docs[doc][start * BLOCK_SIZE : (start + 16) * BLOCK_SIZE]),
                block_size=BLOCK_SIZE,
            )
            self._index.apply(pod, [stored])
            self._index.apply(pod, [BlocksRemoved(block_keys=batch)])
            self.num_events += 2


def percentiles(samples: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return p50 * 1e3, p99 * 1e3, statistics.fmean(ordered) * 1e3


def request_bodies(kind: str, corpus: Corpus, rng: random.Random, count: int) -> list[dict[str, Any]]:
    bodies = []
    for _ in range(count):
        doc = rng.randrange(len(corpus.docs))
        if kind == "tokens/warm":
            bodies.append({"model": MODEL.name, "token_ids": corpus.docs[doc]})
        elif kind == "tokens/fresh":
            tail = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS // 2)]
            bodies.append({"model": MODEL.name, "token_ids": corpus.docs[doc][: PROMPT_TOKENS // 2] + tail})
        else:
            bodies.append({"model": MODEL.name, "block_hashes": corpus.keys[doc]})
    return bodies


def time_http(url: str, bodies: list[dict[str, Any]], *, warm_all: bool = False) -> list[float]:
    """Latency of each request, one at a time on a keep-alive connection, from a separate client process
    (a client thread in this process would fight the server for the GIL and add its switch interval).

    Bodies are JSON-encoded before timing (a router encodes its own request anyway). With `warm_all`,
    every body is sent once untimed first, so the server's hasher memo has seen the prompts.
    """
    encoded = [msgspec.json.encode(body) for body in bodies]
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_client_process, url, encoded, warm_all).result(timeout=600)


def _client_process(url: str, encoded: list[bytes], warm_all: bool) -> list[float]:
    return asyncio.run(_time_requests(url, encoded, warm_all))


async def _time_requests(url: str, encoded: list[bytes], warm_all: bool) -> list[float]:
    headers = {"Content-Type": "application/json"}
    latencies = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for data in encoded if warm_all else encoded[:3]:  # warm the connection and the code paths
            async with session.post(url, data=data, headers=headers) as response:
                await response.read()
        for data in encoded:
            started = time.perf_counter()
            async with session.post(url, data=data, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"score failed: {response.status} {await response.text()}")
            latencies.append(time.perf_counter() - started)
    return latencies


def time_direct(index: KVIndex, bodies: list[dict[str, Any]]) -> list[float]:
    hasher = BlockHasher(algo=MODEL.hash_algo, block_size=BLOCK_SIZE, seed=MODEL.hash_seed)
    settings = ApiSettings()
    latencies = []
    for body in bodies:
        started = time.perf_counter()
        keys = body.get("block_hashes") or hasher.event_hashes(body["token_ids"])
        score_prefix(
            index,
            keys,
            block_size=BLOCK_SIZE,
            tier_weights=settings.tier_weights,
            unknown_tier_weight=settings.unknown_tier_weight,
            pods=None,
        )
        latencies.append(time.perf_counter() - started)
    return latencies


class BackgroundServer:
    """The real app on 127.0.0.1:0, served from its own event loop on a thread of this process."""

    def __init__(self, service: IngestService) -> None:
        self._service = service
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.url = ""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("HTTP server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _serve(self) -> None:
        from aiohttp import web
        from kvindex.api.app import create_app
        from kvindex.api.site import ApiSite

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(
            create_app(self._service, ApiSettings(host="127.0.0.1", port=0)), access_log=None
        )
        await runner.setup()
        await ApiSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1/score"
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()


KINDS = ("tokens/warm", "tokens/fresh", "hashes")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.score", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small index and few requests (smoke test)")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the GIL switch interval for this run (default: Python's 5 ms)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.quick:
        num_pods, blocks_per_pod, num_docs, num_requests = 10, 1_000, 20, 20
    else:
        num_pods, blocks_per_pod, num_docs, num_requests = 100, 10_000, 200, 300

    rng = random.Random(2024)
    started = time.perf_counter()
    corpus = Corpus(rng, num_docs)
    # Never started: the benchmark fills the index itself; a listen endpoint only satisfies the constructor.
    service = IngestService([MODEL], listen="tcp://127.0.0.1:*")
    runtime = service.model(MODEL.name)
    assert runtime is not None
    index = runtime.index
    num_entries = fill_index(index, corpus, rng, num_pods, blocks_per_pod)
    print(
        f"index: {num_pods} pods x {blocks_per_pod} blocks = {num_entries} entries, {index.num_keys()} keys, "
        f"{PROMPT_TOKENS}-token prompts ({PROMPT_TOKENS // BLOCK_SIZE} blocks); setup {time.perf_counter() - started:.1f}s"
    )

    rows: list[list[object]] = []
    with BackgroundServer(service) as server:
        for kind in KINDS:
            for load in ("idle", "ingest"):
                bodies = request_bodies(
                    kind, corpus, random.Random(hash((kind, load)) & 0xFFFF), num_requests
                )
                warm = kind == "tokens/warm"  # the hasher memos have seen these prompts once already
                if warm:
                    time_direct(index, bodies)
                if load == "idle":
                    http = time_http(server.url, bodies, warm_all=warm)
                    direct = time_direct(index, request_bodies(kind, corpus, random.Random(1), num_requests))
                    events_per_s = 0.0
                else:
                    with Churn(index, corpus, num_pods) as churn:
                        http = time_http(server.url, bodies, warm_all=warm)
                        direct = time_direct(
                            index, request_bodies(kind, corpus, random.Random(1), num_requests)
                        )
                    events_per_s = churn.num_events / churn.elapsed
                p50, p99, mean = percentiles(http)
                d50, d99, _ = percentiles(direct)
                rows.append(
                    [
                        kind,
                        load,
                        len(http),
                        round(p50, 2),
                        round(p99, 2),
                        round(mean, 2),
                        round(d50, 2),
                        round(d99, 2),
                        round(events_per_s),
                    ]
                )
    print(
        format_table(
            [
                "request",
                "load",
                "n",
                "http p50 ms",
                "http p99 ms",
                "http mean ms",
                "direct p50 ms",
                "direct p99 ms",
                "ingest events/s",
            ],
            rows,
        )
    )
    print("direct = the same hash + score_prefix as a function call (baseline, same run, no HTTP/JSON)")


if __name__ == "__main__":
    main()
