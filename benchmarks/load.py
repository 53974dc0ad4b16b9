"""`python -m benchmarks.load`: POST /v1/score at the highest rate the box sustains while 100 engines ingest.

Four processes: `kvindex serve` (a subprocess on 127.0.0.1, benchmarks/service.py); a forked engine fleet
(100 simulated vLLM engines, each kvindex.sim's prefix cache with vLLM's LRU eviction behind vLLM's
publisher, PUB + replay ROUTER, vLLM wire bytes); a forked load generator (aiohttp, closed loop:
`--concurrency` requests always in flight, alternating token_ids and block_hashes bodies); and this one,
which orchestrates and samples the server's RSS and /metrics every second.

Every engine serves a steady stream of shared-prefix prompts (10 system prompts of 32 blocks, then 32
blocks of one of its own working set of prompts, a set larger than its cache), so each step stores new
blocks and evicts old ones and the index holds a steady size. The caches are filled first, then the same
load runs untimed for `warmup_s` (60 s), then the measured window. Reported: requests/s, errors (a
non-200, a body without scores, a connection error or timeout), p50/p99/max latency, the ingest rate, the
server's RSS at the window's start and end with its least-squares slope (flat: the fitted drift within
twice the RSS noise), cores used per process, and the load average at start and end.

`--soak`: 10 minutes with engine churn (an engine restarts every 2 s on the same endpoints with seq from
0, small caches evicting on nearly every step, an AllBlocksCleared every 5 s) against small index caps
(`[ingest] index_max_keys`, `index_max_pods_per_key`): the key count must stay within the cap and RSS stop
growing once it is reached (judged from max(cap reached, 20% of the run)). Restarts need fixed endpoints and vLLM binds only `*`, `::` or ipc, so the soak
fleet publishes on ipc sockets in a private directory (a `*` would listen on every interface).
`--quick`: an ~11 s smoke run. `--json FILE` writes every figure. Not part of `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks._process import await_condition, run_main
from benchmarks._table import format_table
from benchmarks.service import KvindexService, pod_id

MODEL = "load"
BLOCK_SIZE = 16
HASH_SEED = "0"
VOCAB_SIZE = 32_000
REQUEST_TIMEOUT_S = 10.0
# Extra seconds any child may outlive the planned run before it stops by itself.
GRACE_S = 120.0
KINDS = ("tokens", "hashes")


@dataclass(frozen=True)
class LoadSpec:
    """One run: the fleet, the prompts, the load generator, and (soak) churn and index caps."""

    duration_s: float = 60.0
    num_engines: int = 100
    capacity_blocks: int = 2_000  # per engine
    steps_per_s: float = 5.0  # per engine; one step = one prompt = one published batch
    num_prefixes: int = 10
    prefix_blocks: int = 32
    suffix_blocks: int = 32
    prompts_per_engine: int = 120  # an engine's working set (larger than its cache: steady eviction)
    engines_per_prompt: int = 5  # working sets overlap: each prompt is in this many engines' sets
    # Closed loop, so this is what the server has queued: on the shared 2-core box 8 gave the highest
    # rate; 16-64 only queued longer (p99 up) for no more requests/s.
    concurrency: int = 8
    num_bodies: int = 4_000  # distinct pre-encoded request bodies the client cycles through
    # Untimed load (engines and client) before the measured window: under this churn the server's RSS
    # climbs for about a minute before it levels off into a sawtooth (see memory_figures).
    warmup_s: float = 60.0
    settle_fraction: float = 0.2  # with no warm-up (soak), RSS is judged after this share of the run
    restart_every_s: float | None = None  # one random engine restarts (seq from 0) this often
    clear_every_s: float | None = None  # one random engine publishes AllBlocksCleared this often
    index_max_keys: int | None = None
    index_max_pods_per_key: int | None = None
    replay_buffer_steps: int = 256  # each engine's replay ring, in batches
    prefill: bool = True  # fill every engine's cache (and so the index) before the clock starts
    seed: int = 0

    @property
    def num_prompts(self) -> int:
        return max(1, self.num_engines * self.prompts_per_engine // self.engines_per_prompt)

    @property
    def prompt_blocks(self) -> int:
        return self.prefix_blocks + self.suffix_blocks

    @property
    def transport(self) -> str:
        return "ipc" if self.restart_every_s is not None else "tcp"

    def ingest_caps(self) -> dict[str, int]:
        caps = {"index_max_keys": self.index_max_keys, "index_max_pods_per_key": self.index_max_pods_per_key}
        return {key: value for key, value in caps.items() if value is not None}


LOAD = LoadSpec()
SOAK = replace(
    LOAD,
    duration_s=600.0,
    capacity_blocks=256,
    restart_every_s=2.0,
    clear_every_s=5.0,
    index_max_keys=10_000,
    index_max_pods_per_key=16,
    prefill=False,  # the index grows into its cap while RSS is watched
    warmup_s=0.0,
)


def quick(spec: LoadSpec) -> LoadSpec:
    """The smoke-test size of `spec`: 20 engines, 8 s (churn, if any, four times as often)."""
    return replace(
        spec,
        duration_s=8.0,
        warmup_s=min(spec.warmup_s, 2.0),
        num_engines=20,
        capacity_blocks=min(spec.capacity_blocks, 512),
        num_bodies=400,
        concurrency=8,
        restart_every_s=None if spec.restart_every_s is None else spec.restart_every_s / 4,
        clear_every_s=None if spec.clear_every_s is None else spec.clear_every_s / 4,
        index_max_keys=None if spec.index_max_keys is None else 1_000,
    )


# --- prompts: the engines' traffic and the load generator's queries ------------------------------


@dataclass
class PromptPool:
    """Every prompt's token ids, raw block digests (what the sim cache keys on) and event hashes.

    Prompt p = system prompt p % num_prefixes + 32 blocks of its own; built once, before the fork, so the
    fleet and the load generator share it copy-on-write.
    """

    tokens: list[array[int]]
    digests: list[list[bytes]]
    event_hashes: list[list[int]]


def build_pool(spec: LoadSpec) -> PromptPool:
    from kvindex.hashing import BlockHasher

    rng = random.Random(spec.seed)
    hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed=HASH_SEED)
    prefixes = [
        [rng.randrange(VOCAB_SIZE) for _ in range(spec.prefix_blocks * BLOCK_SIZE)]
        for _ in range(spec.num_prefixes)
    ]
    pool = PromptPool([], [], [])
    for prompt in range(spec.num_prompts):
        token_ids = prefixes[prompt % spec.num_prefixes] + [
            rng.randrange(VOCAB_SIZE) for _ in range(spec.suffix_blocks * BLOCK_SIZE)
        ]
        digests = [bytes(d) for d in hasher.block_hashes(token_ids)]
        pool.tokens.append(array("H", token_ids))
        pool.digests.append(digests)
        pool.event_hashes.append([int.from_bytes(d[-8:], "big") for d in digests])
    return pool


def working_set(spec: LoadSpec, engine: int) -> list[int]:
    """The prompts engine `engine` serves: a window of the pool, overlapping its neighbours' windows."""
    stride = max(1, spec.prompts_per_engine // spec.engines_per_prompt)
    return [(engine * stride + k) % spec.num_prompts for k in range(spec.prompts_per_engine)]


# --- the engine fleet (forked process) -------------------------------------------------------------


class FleetEngine:
    """One simulated engine: kvindex.sim's prefix cache (vLLM's BlockPool rules, LRU eviction) publishing
    each step's events as one batch through vLLM's publisher. `restart` is a new engine process on the
    same endpoints: an empty cache and seq from 0."""

    def __init__(self, spec: LoadSpec, pub_endpoint: str, replay_endpoint: str, ctx: Any) -> None:
        self._spec = spec
        self._ctx = ctx
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.num_steps = self.num_restarts = self.num_clears = 0
        self.num_sent = self.num_dropped = 0
        self._open()

    def _open(self) -> None:
        import zmq
        from kvindex.replay.publisher import EventPublisher
        from kvindex.sim.cache import SimPrefixCache

        self.cache = SimPrefixCache(self._spec.capacity_blocks, BLOCK_SIZE)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.publisher = EventPublisher(
                    self.pub_endpoint,
                    replay_endpoint=self.replay_endpoint,
                    buffer_steps=self._spec.replay_buffer_steps,
                    ctx=self._ctx,
                )
                break
            except zmq.ZMQError:
                # The old sockets close asynchronously (ZMQ's IO thread): the address frees shortly.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # ok: retrying a bind with a deadline
        self.pub_endpoint = self.publisher.endpoint
        self.replay_endpoint = self.publisher.replay_endpoint or self.replay_endpoint

    def step(self, pool: PromptPool, prompt: int) -> None:
        self.cache.run(f"req-{self.num_steps}", pool.tokens[prompt], pool.digests[prompt])
        self.num_steps += 1
        self._publish()

    def clear(self) -> None:
        if self.cache.reset_prefix_cache():
            self.num_clears += 1
        self._publish()

    def restart(self) -> None:
        self.close()
        self.num_restarts += 1
        self._open()

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(events)

    def last_seq(self) -> int | None:
        self.publisher.flush(5.0)
        return self.publisher.last_seq

    def close(self) -> None:
        self.publisher.close()
        self.num_sent += self.publisher.sent_count
        self.num_dropped += self.publisher.dropped_count


def _fleet_main(
    conn: multiprocessing.connection.Connection, spec: LoadSpec, pool: PromptPool, ipc_dir: str
) -> None:
    """The engines. Commands (tuples) from the parent: ("prefill",) -> ("prefilled", last seqs);
    ("run", seconds) -> paced steps with churn -> ("ran", stats); ("close",). Exits by itself if the parent
    goes away or stays silent past the run's length plus GRACE_S."""
    import zmq

    ctx: Any = zmq.Context()
    rng = random.Random(spec.seed + 1)
    engines: list[FleetEngine] = []
    try:
        for index in range(spec.num_engines):
            if spec.transport == "ipc":
                pub, replay = f"ipc://{ipc_dir}/e{index}.pub", f"ipc://{ipc_dir}/e{index}.replay"
            else:
                pub, replay = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
            engines.append(FleetEngine(spec, pub, replay, ctx))
        conn.send(("endpoints", [(e.pub_endpoint, e.replay_endpoint) for e in engines]))
        sets = [working_set(spec, index) for index in range(spec.num_engines)]
        while conn.poll(spec.warmup_s + spec.duration_s + GRACE_S):
            command = conn.recv()
            if command[0] == "prefill":
                _prefill(engines, sets, pool, rng)
                conn.send(("prefilled", [engine.last_seq() for engine in engines]))
            elif command[0] == "run":
                conn.send(("ran", _run_fleet(engines, sets, pool, rng, spec, float(command[1]), conn)))
            else:
                break
    except EOFError:
        pass  # the parent is gone
    finally:
        for engine in engines:
            engine.close()
        ctx.term()


def _prefill(engines: list[FleetEngine], sets: list[list[int]], pool: PromptPool, rng: random.Random) -> None:
    """Fill every cache (round robin, so no engine runs far ahead of the indexer) before the clock starts."""
    pending = list(range(len(engines)))
    for _ in range(10_000):
        if not pending:
            return
        for index in pending:
            engines[index].step(pool, rng.choice(sets[index]))
        pending = [
            i for i in pending if engines[i].cache.num_cached_blocks < 0.9 * engines[i].cache.capacity_blocks
        ]


def _run_fleet(
    engines: list[FleetEngine],
    sets: list[list[int]],
    pool: PromptPool,
    rng: random.Random,
    spec: LoadSpec,
    duration_s: float,
    conn: multiprocessing.connection.Connection,
) -> dict[str, Any]:
    """Steps paced at num_engines x steps_per_s (round robin), restarts and clears on their schedules."""
    interval = 1.0 / (len(engines) * spec.steps_per_s)
    began = time.monotonic()
    end = began + duration_s
    next_step = began
    next_restart = began + spec.restart_every_s if spec.restart_every_s else float("inf")
    next_clear = began + spec.clear_every_s if spec.clear_every_s else float("inf")
    next_poll = began + 0.1
    steps = skipped = restarts = clears = 0
    cpu_began = time.process_time()
    while (now := time.monotonic()) < end:
        if now >= next_poll:
            next_poll = now + 0.1
            if conn.poll():
                break  # the parent wants to stop early
        if now >= next_restart:
            next_restart += spec.restart_every_s or float("inf")
            engines[rng.randrange(len(engines))].restart()
            restarts += 1
        if now >= next_clear:
            next_clear += spec.clear_every_s or float("inf")
            engines[rng.randrange(len(engines))].clear()
            clears += 1
        if now < next_step:
            time.sleep(min(next_step - now, 0.02))  # ok: pacing the steps
            continue
        if next_step < now - 1.0:  # more than a second behind (CPU starved): drop the backlog
            behind = int((now - 1.0 - next_step) / interval)
            skipped += behind
            next_step += behind * interval
        index = steps % len(engines)
        engines[index].step(pool, rng.choice(sets[index]))
        steps += 1
        next_step += interval
    elapsed = time.monotonic() - began
    return {
        "steps": steps,
        "steps_per_s": steps / elapsed if elapsed else 0.0,
        "skipped_steps": skipped,
        "restarts": restarts,
        "clears": clears,
        "cpu_s": time.process_time() - cpu_began,
        "cached_blocks": sum(engine.cache.num_cached_blocks for engine in engines),
        "batches_dropped": sum(e.num_dropped + e.publisher.dropped_count for e in engines),
        "restarts_by_engine": [engine.num_restarts for engine in engines],
    }


class Fleet:
    """The forked engine process, seen from the parent; always stopped on exit."""

    def __init__(self, spec: LoadSpec, pool: PromptPool) -> None:
        self.spec = spec
        self._ipc_dir = tempfile.mkdtemp(prefix="kvl-")
        context = multiprocessing.get_context("fork")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_fleet_main, args=(child_conn, spec, pool, self._ipc_dir), daemon=True, name="engines"
        )
        self.endpoints: list[tuple[str, str]] = []

    def __enter__(self) -> Fleet:
        self._process.start()
        self.endpoints = self._expect("endpoints", 120.0)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._conn.send(("close",))
        except OSError:
            pass
        self._process.join(20)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def _expect(self, what: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the engine process sent no {what!r} within {timeout_s:.0f}s")
        name, value = self._conn.recv()
        if name != what:
            raise RuntimeError(f"the engine process sent {name!r}, expected {what!r}")
        return value

    def prefill(self) -> list[int | None]:
        self._conn.send(("prefill",))
        seqs: list[int | None] = self._expect("prefilled", 300.0)
        return seqs

    def start_run(self, duration_s: float) -> None:
        self._conn.send(("run", duration_s))

    def finish_run(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._expect("ran", self.spec.warmup_s + self.spec.duration_s + GRACE_S)
        return stats


# --- the load generator (forked process) ------------------------------------------------------------


def request_bodies(spec: LoadSpec, pool: PromptPool) -> list[tuple[str, bytes]]:
    """(kind, JSON body) pairs, kinds alternating: a pool prompt's token ids, or its event hashes."""
    rng = random.Random(spec.seed + 2)
    bodies = []
    for index in range(spec.num_bodies):
        prompt = rng.randrange(spec.num_prompts)
        kind = KINDS[index % len(KINDS)]
        if kind == "tokens":
            body: dict[str, Any] = {"model": MODEL, "token_ids": pool.tokens[prompt].tolist()}
        else:
            body = {"model": MODEL, "block_hashes": pool.event_hashes[prompt]}
        bodies.append((kind, json.dumps(body, separators=(",", ":")).encode()))
    return bodies


def percentile_ms(ordered: Sequence[float], fraction: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3


@dataclass
class KindResult:
    latencies_s: array[float] = field(default_factory=lambda: array("d"))
    errors: int = 0

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies_s)
        return {
            "requests": len(ordered),
            "errors": self.errors,
            "p50_ms": percentile_ms(ordered, 0.5),
            "p99_ms": percentile_ms(ordered, 0.99),
            "max_ms": ordered[-1] * 1e3 if ordered else None,
        }


async def fire(
    url: str, bodies: Sequence[tuple[str, bytes]], concurrency: int, duration_s: float
) -> dict[str, Any]:
    """Closed loop: `concurrency` workers each send the next body as soon as their last answer is read,
    until `duration_s` has passed. Every request counts (its latency and, if it failed, why)."""
    import aiohttp

    results = {kind: KindResult() for kind in KINDS}
    reasons: Counter[str] = Counter()
    per_second: list[int] = [0] * (int(duration_s) + 2)
    errors_per_second: list[int] = [0] * (int(duration_s) + 2)
    max_s_per_second: list[float] = [0.0] * (int(duration_s) + 2)
    empty_answers = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    cpu_began = time.process_time()
    began = time.perf_counter()
    deadline = began + duration_s
    last_done = began

    async def worker(first: int, session: aiohttp.ClientSession) -> None:
        nonlocal empty_answers, last_done
        index = first
        while (started := time.perf_counter()) < deadline:
            kind, body = bodies[index % len(bodies)]
            index += concurrency
            reason = None
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    answer = await response.read()
                    if response.status != 200:
                        reason = f"HTTP {response.status}"
                    elif b'"scores":' not in answer:
                        reason = "answer without scores"
                    elif b'"scores":[]' in answer:
                        empty_answers += 1
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                reason = type(exc).__name__
            done = time.perf_counter()
            last_done = max(last_done, done)
            second = min(int(started - began), len(per_second) - 1)
            per_second[second] += 1
            results[kind].latencies_s.append(done - started)
            max_s_per_second[second] = max(max_s_per_second[second], done - started)
            if reason is not None:
                results[kind].errors += 1
                reasons[reason] += 1
                errors_per_second[second] += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(w, session) for w in range(concurrency)))
    elapsed = last_done - began
    total = KindResult()
    for result in results.values():
        total.latencies_s.extend(result.latencies_s)
        total.errors += result.errors
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(total.latencies_s) / elapsed if elapsed > 0 else 0.0,
        "all": total.summary(),
        "kinds": {kind: result.summary() for kind, result in results.items()},
        "error_reasons": dict(reasons),
        "empty_answers": empty_answers,
        "per_second": per_second[: int(duration_s)],
        "errors_per_second": errors_per_second[: int(duration_s)],
        "max_ms_per_second": [round(value * 1e3, 2) for value in max_s_per_second[: int(duration_s)]],
        "cpu_s": time.process_time() - cpu_began,
    }


def _client_main(conn: multiprocessing.connection.Connection, spec: LoadSpec, pool: PromptPool) -> None:
    """For each ("go", url, seconds): fire, send ("result", figures). Stops on anything else, or when the
    parent stays silent past the run's length plus GRACE_S."""
    try:
        bodies = request_bodies(spec, pool)
        del pool
        conn.send(("ready", len(bodies)))
        while conn.poll(spec.warmup_s + spec.duration_s + GRACE_S + 300.0):
            command = conn.recv()
            if command[0] != "go":
                return
            _, url, duration_s = command
            conn.send(("result", asyncio.run(fire(url, bodies, spec.concurrency, duration_s))))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone


class LoadClient:
    """The forked load generator, seen from the parent; always stopped on exit."""

    def __init__(self, spec: LoadSpec, pool: PromptPool) -> None:
        self.spec = spec
        context = multiprocessing.get_context("fork")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_client_main, args=(child_conn, spec, pool), daemon=True, name="load-client"
        )

    def __enter__(self) -> LoadClient:
        self._process.start()
        self._expect("ready", 120.0)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._conn.send(("stop",))
        except OSError:
            pass
        self._process.join(REQUEST_TIMEOUT_S + 5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def _expect(self, what: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the load generator sent no {what!r} within {timeout_s:.0f}s")
        name, value = self._conn.recv()
        if name != what:
            raise RuntimeError(f"the load generator sent {name!r}, expected {what!r}")
        return value

    def start(self, url: str, duration_s: float) -> None:
        self._conn.send(("go", url, duration_s))

    def done(self) -> bool:
        return self._conn.poll()

    def result(self) -> dict[str, Any]:
        figures: dict[str, Any] = self._expect("result", REQUEST_TIMEOUT_S + 30.0)
        return figures


# --- the server, sampled --------------------------------------------------------------------------

# /metrics families read every second, summed over their labels (by label too where the key names one).
SAMPLED_FAMILIES = {
    "kvindex_index_keys": "keys",
    "kvindex_index_entries": "entries",
    "kvindex_events_applied_total": "events_applied",
    "kvindex_events_dropped_total": "events_dropped",
    "kvindex_gaps_total": "gaps",
    "kvindex_history_lost_total": "history_lost",
    "kvindex_restarts_total": "restarts",
    "kvindex_replays_total": "replays",
    "kvindex_hash_mismatches_total": "hash_mismatches",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The SAMPLED_FAMILIES of a Prometheus exposition, each summed over its series."""
    values = dict.fromkeys(SAMPLED_FAMILIES.values(), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = SAMPLED_FAMILIES.get(name)
        if key is not None:
            values[key] += float(line.rsplit(" ", 1)[1])
    return values


def scrape(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    metrics: dict[str, float]


def rss_fit(samples: Sequence[Sample]) -> tuple[float, float] | None:
    """Least-squares line through RSS over time: (slope MiB/min, standard deviation of the residuals MiB)."""
    if len(samples) < 3:
        return None
    ts = [s.t_s / 60.0 for s in samples]
    ys = [s.rss_bytes / 2**20 for s in samples]
    t_mean, y_mean = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - t_mean) ** 2 for t in ts)
    if var == 0:
        return None
    slope = sum((t - t_mean) * (y - y_mean) for t, y in zip(ts, ys, strict=True)) / var
    residuals = [y - (y_mean + slope * (t - t_mean)) for t, y in zip(ts, ys, strict=True)]
    return slope, (sum(r * r for r in residuals) / (len(residuals) - 2)) ** 0.5


# NOTE: RSS is a sawtooth here, not a line: the heap grows by a few MiB and glibc's malloc_trim (run when
# ingest drains) hands pages back. A trend counts only when it exceeds that noise.
MIN_TOLERANCE_MIB = 2.0


def memory_figures(samples: Sequence[Sample], since_s: float) -> dict[str, Any]:
    """RSS from the first sample at or after `since_s` to the end: start, end, min, max, slope, and flat
    or not: the fitted drift over the window (slope x length) within twice the residuals' standard
    deviation (at least MIN_TOLERANCE_MIB)."""
    window = [s for s in samples if s.t_s >= since_s]
    fit = rss_fit(window)
    if fit is None:
        return {"samples": len(window)}
    slope, noise = fit
    drift = slope * (window[-1].t_s - window[0].t_s) / 60.0
    tolerance = max(MIN_TOLERANCE_MIB, 2.0 * noise)
    return {
        "samples": len(window),
        "since_s": window[0].t_s,
        "rss_start_mib": window[0].rss_bytes / 2**20,
        "rss_end_mib": window[-1].rss_bytes / 2**20,
        "rss_min_mib": min(s.rss_bytes for s in window) / 2**20,
        "rss_max_mib": max(s.rss_bytes for s in window) / 2**20,
        "slope_mib_per_min": slope,
        "drift_mib": drift,
        "noise_mib": noise,
        "tolerance_mib": tolerance,
        "flat": abs(drift) <= tolerance,
    }


# --- one run ----------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(spec: LoadSpec) -> dict[str, Any]:
    """Fleet, server, client; prefill, then `spec.duration_s` of load while sampling; every figure."""
    report: dict[str, Any] = {
        "spec": asdict(spec),
        "cores": os.cpu_count(),
        "load_avg_start": os.getloadavg(),
    }
    began = time.monotonic()
    pool = build_pool(spec)
    log(
        f"  {spec.num_prompts} prompts of {spec.prompt_blocks} blocks hashed in {time.monotonic() - began:.1f}s"
    )
    # Fork both children before this process has a thread or a ZMQ context.
    with LoadClient(spec, pool) as client, Fleet(spec, pool) as fleet:
        del pool
        pub_endpoints = [pub for pub, _ in fleet.endpoints]
        replay_endpoints: list[str | None] = [replay for _, replay in fleet.endpoints]
        with KvindexService(
            pub_endpoints,
            model=MODEL,
            hash_seed=HASH_SEED,
            block_size=BLOCK_SIZE,
            replay_endpoints=replay_endpoints,
            ingest=spec.ingest_caps(),
            startup_timeout_s=120.0,
        ) as service:
            try:
                report |= _measure(spec, service, fleet, client)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}; kvindex log: {service.log_tail(1500)}") from exc
            report["server_log_tail"] = service.log_tail(4000)
    report["load_avg_end"] = os.getloadavg()
    return report


def _ready(service: KvindexService) -> bool:
    assert service.client is not None
    try:
        service.client.request("GET", "/readyz")
    except RuntimeError:  # 503 until every pod has joined
        return False
    return True


class Sampler:
    """The server's RSS and /metrics once a second; `t_s` is relative to `origin` (the measured window's
    start, so warm-up samples are negative)."""

    def __init__(self, service: KvindexService, origin: float) -> None:
        self.service = service
        self.origin = origin
        self.samples: list[Sample] = []
        self._next = time.monotonic()
        self._next_log = self._next + 60.0

    def take(self) -> Sample:
        now = time.monotonic()
        sample = Sample(now - self.origin, self.service.rss_bytes(), parse_metrics(scrape(self.service.port)))
        self.samples.append(sample)
        return sample

    def until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Sample every second until `done()`; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the load generator did not finish within {timeout_s:.0f}s")
            if now >= self._next:
                self._next += 1.0
                sample = self.take()
                if now >= self._next_log:
                    self._next_log += 60.0
                    log(
                        f"  t={sample.t_s:.0f}s RSS {sample.rss_bytes / 2**20:.1f} MiB, index "
                        f"{sample.metrics['keys']:,.0f} keys / {sample.metrics['entries']:,.0f} entries, "
                        f"load average {os.getloadavg()[0]:.2f}"
                    )
            time.sleep(max(0.0, min(0.05, self._next - time.monotonic())))  # ok: sampling clock


def _measure(spec: LoadSpec, service: KvindexService, fleet: Fleet, client: LoadClient) -> dict[str, Any]:
    await_condition(lambda: _ready(service), 120.0, "kvindex /readyz (every pod joined)", poll_s=0.2)
    log(f"  kvindex serve (pid {service.pid}) joined {spec.num_engines} engines")
    if spec.prefill:
        prefill_began = time.monotonic()
        seqs = fleet.prefill()
        expected = {engine: seq for engine, seq in enumerate(seqs) if seq is not None}
        await_condition(
            lambda: service.caught_up(expected), 300.0, "kvindex to apply the prefill", poll_s=0.2
        )
        log(
            f"  prefill: {sum(s + 1 for s in expected.values()):,} batches applied in "
            f"{time.monotonic() - prefill_began:.1f}s"
        )
    prefill_metrics = parse_metrics(scrape(service.port))
    log(
        f"  index {prefill_metrics['keys']:,.0f} keys, {prefill_metrics['entries']:,.0f} entries; "
        f"warm-up {spec.warmup_s:.0f}s, then load for {spec.duration_s:.0f}s"
    )
    url = f"http://127.0.0.1:{service.port}/v1/score"
    pids = {"server": service.pid, "engines": fleet.pid, "client": client.pid}
    sampler = Sampler(service, origin=time.monotonic() + spec.warmup_s)
    client_timeout_s = spec.warmup_s + spec.duration_s + REQUEST_TIMEOUT_S + 30.0
    fleet.start_run(spec.warmup_s + spec.duration_s)
    warmup: dict[str, Any] | None = None
    if spec.warmup_s > 0:
        client.start(url, spec.warmup_s)
        sampler.until(client.done, client_timeout_s)
        warmup = client.result()
    cpu_began = {name: cpu_seconds(pid) for name, pid in pids.items()}
    window_began = time.monotonic()
    first = sampler.take()
    client.start(url, spec.duration_s)
    sampler.until(client.done, client_timeout_s)
    elapsed = time.monotonic() - window_began
    cpu = {name: cpu_seconds(pid) - cpu_began[name] for name, pid in pids.items()}
    load = client.result()
    fleet_stats = fleet.finish_run()
    last = sampler.take()
    samples = sampler.samples
    pods = service.pods()
    restarts_by_pod = {pod["pod"]: pod["restarts_total"] for pod in pods}
    span = last.t_s - first.t_s
    applied = last.metrics["events_applied"] - first.metrics["events_applied"]
    # Soak (no warm-up): RSS is judged once the run has settled; load: from the end of the warm-up.
    memory_since_s = 0.0 if spec.warmup_s > 0 else spec.settle_fraction * spec.duration_s
    figures: dict[str, Any] = {
        "load": load,
        "warmup": warmup,
        "fleet": fleet_stats,
        "cores_used": {name: seconds / elapsed for name, seconds in cpu.items()},
        "ingest_events_per_s": applied / span if span > 0 else None,
        "prefill_index": {"keys": prefill_metrics["keys"], "entries": prefill_metrics["entries"]},
        "counters_delta": {
            key: last.metrics[key] - samples[0].metrics[key]
            for key in ("events_dropped", "gaps", "history_lost", "restarts", "replays", "hash_mismatches")
        },
        "pod_states": dict(Counter(pod["state"] for pod in pods)),
        "restarts_by_pod": restarts_by_pod,
        "restart_mismatches": {
            pod_id(engine): {"engine": restarted, "kvindex": restarts_by_pod.get(pod_id(engine))}
            for engine, restarted in enumerate(fleet_stats["restarts_by_engine"])
            if restarted != restarts_by_pod.get(pod_id(engine))
        },
        "samples": [asdict(sample) for sample in samples],
        "rss_first_mib": samples[0].rss_bytes / 2**20,
        "memory": memory_figures(samples, memory_since_s),
        "keys_max": max(s.metrics["keys"] for s in samples),
        "entries_max": max(s.metrics["entries"] for s in samples),
    }
    if spec.index_max_keys is not None:
        low_water = spec.index_max_keys - spec.index_max_keys // 64
        reached = next((s for s in samples if s.metrics["keys"] >= low_water), None)
        figures["cap"] = {
            "index_max_keys": spec.index_max_keys,
            "index_max_pods_per_key": spec.index_max_pods_per_key,
            "reached_at_s": None if reached is None else reached.t_s,
            "rss_at_cap_mib": None if reached is None else reached.rss_bytes / 2**20,
            "keys_within_cap": figures["keys_max"] <= spec.index_max_keys,
            # NOTE: the gauge is read without the shard's lock, so a scrape can land inside one store,
            # between its inserts and its eviction: count how often and by how much.
            "scrapes_over_cap": sum(1 for s in samples if s.metrics["keys"] > spec.index_max_keys),
            "max_over_cap": max(0.0, figures["keys_max"] - spec.index_max_keys),
            "entries_within_cap": figures["entries_max"]
            <= spec.index_max_keys * (spec.index_max_pods_per_key or 256),
            "memory_after_cap": None
            if reached is None
            else memory_figures(samples, max(reached.t_s, memory_since_s)),
        }
    return figures


# --- report -------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def score_table(report: dict[str, Any]) -> str:
    load = report["load"]
    rows: list[list[object]] = []
    for label, figures in [("all", load["all"])] + [(kind, load["kinds"][kind]) for kind in KINDS]:
        rate = figures["requests"] / load["elapsed_s"] if load["elapsed_s"] else 0.0
        rows.append(
            [
                label,
                f"{figures['requests']:,}",
                f"{figures['errors']:,}",
                fmt(rate, 0),
                fmt(figures["p50_ms"]),
                fmt(figures["p99_ms"]),
                fmt(figures["max_ms"]),
            ]
        )
    return format_table(["requests", "n", "errors", "req/s", "p50 ms", "p99 ms", "max ms"], rows)


def server_table(report: dict[str, Any]) -> str:
    memory = report["memory"]
    load = report["load"]
    per_second = load["per_second"][1:-1] or load["per_second"]
    cores = report["cores_used"]
    counters = report["counters_delta"]
    flat = "flat" if memory.get("flat") else "NOT flat"
    warmup = report["warmup"]
    max_ms = load["max_ms_per_second"]
    worst_second = max(range(len(max_ms)), key=max_ms.__getitem__) if max_ms else "-"
    stalls = sum(1 for value in max_ms if value > 100.0)
    rows: list[list[object]] = []
    if warmup is not None:
        rows.append(
            [
                "warm-up (untimed, same load)",
                f"{report['spec']['warmup_s']:.0f} s",
                f"{warmup['all']['requests']:,} requests, {warmup['all']['errors']} errors; "
                f"RSS {report['rss_first_mib']:.1f} MiB at its start",
            ]
        )
    rows += [
        ["score requests/s (closed loop)", fmt(load["requests_per_s"], 0), f"{report['spec']['concurrency']} in flight"],
        ["slowest / fastest whole second", f"{min(per_second, default=0):,} / {max(per_second, default=0):,}", "req/s"],
        ["slowest request", f"{fmt(load['all']['max_ms'])} ms", f"sent at t={worst_second}s; {stalls} seconds held a request over 100 ms"],
        ["errors", f"{load['all']['errors']:,}", ", ".join(f"{k} {v}" for k, v in load["error_reasons"].items()) or "none"],
        ["answers naming no pod", f"{load['empty_answers']:,}", "of 200s (index churns; not an error)"],
        ["ingest, events applied/s", fmt(report["ingest_events_per_s"], 0), f"{report['fleet']['steps_per_s']:,.0f} batches/s published"],
        ["index keys / entries at end", f"{report['samples'][-1]['metrics']['keys']:,.0f} / {report['samples'][-1]['metrics']['entries']:,.0f}", f"max {report['keys_max']:,.0f} / {report['entries_max']:,.0f}"],
        ["RSS after warm-up MiB" if warmup else "RSS after settling MiB", fmt(memory.get("rss_start_mib"), 1), f"at t={fmt(memory.get('since_s'), 0)}s of the window (RSS at t=0: {report['samples'][0]['rss_bytes'] / 2**20:.1f})" if not warmup else "at the window's start"],
        ["RSS at end MiB", fmt(memory.get("rss_end_mib"), 1), f"min {fmt(memory.get('rss_min_mib'), 1)}, max {fmt(memory.get('rss_max_mib'), 1)}"],
        ["RSS slope MiB/min", fmt(memory.get("slope_mib_per_min"), 2), f"{flat}: fitted drift {fmt(memory.get('drift_mib'), 1)} MiB over the window, tolerance {fmt(memory.get('tolerance_mib'), 1)} (2 sd of the residuals)"],
        ["cores used: server / engines / client", f"{cores['server']:.2f} / {cores['engines']:.2f} / {cores['client']:.2f}", f"of {report['cores']}"],
        ["gaps / history lost / replays / restarts / dropped", f"{counters['gaps']:.0f} / {counters['history_lost']:.0f} / {counters['replays']:.0f} / {counters['restarts']:.0f} / {counters['events_dropped']:.0f}", f"hash mismatches {counters['hash_mismatches']:.0f}"],
        ["pod states at end", ", ".join(f"{k} {v}" for k, v in sorted(report["pod_states"].items())), ""],
        ["load average start / end", f"{report['load_avg_start'][0]:.2f} / {report['load_avg_end'][0]:.2f}", "1-minute"],
    ]  # fmt: skip
    return format_table(["measure", "value", "detail"], rows)


def cap_table(report: dict[str, Any]) -> str:
    cap = report["cap"]
    fleet = report["fleet"]
    mismatches = report["restart_mismatches"]
    over = {pod: m for pod, m in mismatches.items() if (m["kvindex"] or 0) > m["engine"]}
    under = len(mismatches) - len(over)
    after = cap["memory_after_cap"] or {}
    bounded = "bounded" if after.get("flat") and cap["entries_within_cap"] else "NOT bounded"
    if cap["keys_within_cap"]:
        keys_detail = (
            "within the caps"
            if cap["entries_within_cap"]
            else "entries OVER index_max_keys x max_pods_per_key"
        )
    else:
        keys_detail = (
            f"keys over the cap in {cap['scrapes_over_cap']} of {len(report['samples'])} scrapes, by at most "
            f"{cap['max_over_cap']:.0f} (read inside a store, before its eviction)"
        )
    rows: list[list[object]] = [
        ["index_max_keys / max_pods_per_key", f"{cap['index_max_keys']:,} / {cap['index_max_pods_per_key']}", "[ingest] caps"],
        ["cap reached at", f"{fmt(cap['reached_at_s'], 0)} s", "keys first at the shard's low-water mark"],
        ["RSS at start / when capped MiB", f"{fmt(report['rss_first_mib'], 1)} / {fmt(cap['rss_at_cap_mib'], 1)}", ""],
        ["max keys / max entries", f"{report['keys_max']:,.0f} / {report['entries_max']:,.0f}", keys_detail],
        ["RSS once capped: start / end / max MiB", f"{fmt(after.get('rss_start_mib'), 1)} / {fmt(after.get('rss_end_mib'), 1)} / {fmt(after.get('rss_max_mib'), 1)}", f"from t={fmt(after.get('since_s'), 0)}s"],
        ["RSS slope once capped MiB/min", fmt(after.get("slope_mib_per_min"), 2), f"{bounded}: fitted drift {fmt(after.get('drift_mib'), 1)} MiB, tolerance {fmt(after.get('tolerance_mib'), 1)} (2 sd of the residuals)"],
        ["engine restarts / AllBlocksCleared", f"{fleet['restarts']} / {fleet['clears']}", f"kvindex counted {report['counters_delta']['restarts']:.0f} restarts"],
        ["pods kvindex counted more restarts for", f"{len(over)}", ", ".join(f"{pod}: engine {m['engine']}, kvindex {m['kvindex']}" for pod, m in list(over.items())[:3]) or "none"],
        ["pods kvindex counted fewer restarts for", f"{under}", "expected when no batch of an incarnation reached kvindex (restarted again first)"],
    ]  # fmt: skip
    return format_table(["soak", "value", "detail"], rows)


def print_report(report: dict[str, Any], soak: bool) -> None:
    spec = LoadSpec(**report["spec"])
    print(
        f"== load: {spec.duration_s:.0f}s after a {spec.warmup_s:.0f}s warm-up, {spec.num_engines} engines ({spec.capacity_blocks:,}-block caches, "
        f"{spec.steps_per_s:g} prompts/s each, {spec.transport}), {spec.prompt_blocks}-block prompts "
        f"({spec.num_prefixes} shared {spec.prefix_blocks}-block system prompts); score bodies alternate "
        f"token_ids / block_hashes; one aiohttp client process; {report['cores']} cores"
    )
    print(score_table(report))
    print()
    print(server_table(report))
    if soak and "cap" in report:
        print()
        churn = f"an engine restarts every {spec.restart_every_s:g}s, AllBlocksCleared every {spec.clear_every_s:g}s"
        print(f"== soak: {churn}")
        print(cap_table(report))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--soak", action="store_true", help="10 minutes with engine churn against small index caps"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a ~10 s smoke run (20 engines); numbers meaningless"
    )
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default 60; soak 600)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 16)")
    parser.add_argument("--engines", type=int, default=None, help="simulated engines (default 100)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure (and the samples) here")
    return parser.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    spec = SOAK if args.soak else LOAD
    if args.quick:
        spec = quick(spec)
    overrides: dict[str, Any] = {}
    if args.duration is not None:
        overrides["duration_s"] = args.duration
    if args.concurrency is not None:
        overrides["concurrency"] = args.concurrency
    if args.engines is not None:
        overrides["num_engines"] = args.engines
    spec = replace(spec, **overrides)
    if spec.duration_s < 3 or spec.concurrency < 1 or spec.num_engines < 1:
        raise SystemExit("--duration must be >= 3, --concurrency and --engines >= 1")
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = spec_from_args(args)
    log(f"load benchmark: {spec}")
    report = run(spec)
    print_report(report, args.soak)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main, "the server, engines and load generator were stopped")
