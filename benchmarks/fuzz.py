"""`python -m benchmarks.fuzz`: the write path under hostile input, in connect mode and in bind mode.

A seeded generator mutates vLLM 0.33's captured payloads (truncations, bit flips, msgpack values of the
wrong type, declared and genuinely huge arrays, deep nesting, old and partial shapes) and frames (bad seqs,
wrong topics, 1 to 10 frames), and a separate process sends them into a real IngestService while good
engines (real EventPublishers with replay rings) publish beside them. Connect mode: hostile pods kvindex
dials as its own (one has a replay ROUTER that answers garbage). Bind mode: raw PUB sockets dialling
kvindex's listen endpoint with hostile topics.

Checked after each mode: the ingest threads are alive and still ingest (one more good batch is indexed),
every good pod's index entries are exactly the blocks its engine holds, no exception reached a catch-all,
every frame sent was seen by the subscriber, and `counters().dropped` equals, reason by reason, what the
frames deserve: frame and topic reasons from the wire rules (written here, from the spec), payload reasons
from `decode_batch` itself (so this checks that the pipeline decodes and counts every delivered payload
exactly once; whether decode's verdicts are right is tests/indexer/test_decode.py's job).

The frames and the rules for what each deserves are in benchmarks/fuzz_frames.py. `python -m
benchmarks.fuzz --frames N [--seed S] [--mode connect|bind|both]`; not part of `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.frames import END_SEQ_BYTES, encode_seq
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.subscriber import Subscriber
from kvindex.replay.wire import AllBlocksCleared

from benchmarks._table import format_table
from benchmarks.fuzz_frames import (
    BLOCK_SIZE,
    CONNECT_HOSTILE_PODS,
    MODEL,
    MODEL_NAMES,
    NUM_BIND_SOCKETS,
    NUM_GOOD_PODS,
    PAYLOAD_KINDS,
    Corpus,
    Fuzzer,
    block_removed,
    block_stored,
    expected_intake_drop,
    expected_replay_drop,
    good_hasher,
    good_tokens,
    load_corpus,
    payload_drops,
    victim_keys,
)

# Bind mode: the good pods' replay ROUTERs are reached through the pod id, which is their port.
PORT_TEMPLATE = "tcp://127.0.0.1:{pod}"
# Hostile engines that restart during the run: connect mode rebinds a hostile PUB on its address (kvindex
# reconnects and checks the pod's ring), bind mode replaces a hostile socket by a new connection (kvindex
# stops trusting every bind-mode stream's next unexpected seq).
NUM_RESTARTS = 6
GOOD_INTERVAL_S = 0.002  # a good engine step every 2 ms while the hostile frames flow
SEND_CHUNK = 256  # frames generated at once, then sent
SETTLE_TIMEOUT_S = 120.0
STALL_TIMEOUT_S = 120.0  # the subscriber read nothing for this long while frames were being sent: a hang


def max_router_silences(num_frames: int) -> int:
    """Replay requests the garbage ROUTER leaves unanswered: each costs kvindex's worker a replay timeout."""
    return min(3, 1 + num_frames // 200_000)


# --- the garbage replay ROUTER (connect mode's hostile-router pod) ----------------------------------------


class GarbageRouter:
    """Answers replay requests with a mix of the pod's recent batches, wrong seqs and non-vLLM frames;
    tallies what kvindex will count for them."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        rng: random.Random,
        corpus: Corpus,
        tally: Counter[str],
        *,
        max_silences: int,
    ) -> None:
        self.sock = sock
        self.max_silences = max_silences
        self.rng = rng
        self.corpus = corpus
        self.tally = tally
        # (seq, payload) sent live to this pod whose payloads decode: the fake ring.
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=2_000)
        self.requests = 0
        self.silences = 0

    def serve(self) -> None:
        while True:
            try:
                request = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) != 3:
                continue
            self.requests += 1
            self._answer(request[0], int.from_bytes(request[2], "big"))

    def _answer(self, identity: bytes, start_seq: int) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.03 and self.silences < self.max_silences:
            self.silences += 1
            return
        replies: list[list[bytes]] = []
        if roll < 0.7:
            for seq, payload in self.ring:
                if seq >= start_seq and len(replies) < 20:
                    replies.append(self._shape(b"kv-events", seq, payload))
        elif roll < 0.8:
            for _ in range(rng.randint(1, 5)):
                replies.append(self._shape(b"t", rng.getrandbits(64) | 1, rng.choice(self.corpus.payloads)))
        for _ in range(rng.choice((0, 0, 1, 3))):
            replies.insert(rng.randrange(len(replies) + 1), self._garbage())
        replies.append([b"", b"", END_SEQ_BYTES, b""])
        for frames in replies:
            reason = expected_replay_drop(frames)
            if reason is not None:
                self.tally[f"replay_{reason}"] += 1
            elif frames[-2] != END_SEQ_BYTES:
                payload_drops(frames[-1], self.tally)
            self.sock.send_multipart([identity, *frames])

    def _shape(self, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
        """A valid reply as the DEALER sees it: vLLM 0.33's 4 frames, or an older 3- or 2-frame one."""
        how = self.rng.random()
        if how < 0.9:
            return [b"", topic, encode_seq(seq), payload]
        if how < 0.95:
            return [topic, encode_seq(seq), payload]
        return [encode_seq(seq), payload]

    def _garbage(self) -> list[bytes]:
        rng = self.rng
        payload = rng.choice(self.corpus.payloads)
        return rng.choice(
            (
                [b"x"],
                [b"", b"t", encode_seq(1), payload, b"extra"],
                [b"not-empty", b"t", encode_seq(1), payload],
                [b"", b"t", b"\x00\x01", payload],
                [b"", b"", END_SEQ_BYTES, b"payload after the end"],
            )
        )


# --- the hostile process -------------------------------------------------------------------------------


class HostilePlan(msgspec.Struct, frozen=True):
    mode: str
    seed: int
    num_frames: int
    good_pod_ids: tuple[str, ...]
    victims: tuple[int, ...]


class HostileReport(msgspec.Struct):
    sent: int = 0
    kinds: dict[str, int] = {}
    expected_dropped: dict[str, int] = {}
    to_worker: int = 0  # frames past intake (decoded by a worker)
    replay_requests: int = 0
    replay_silences: int = 0
    send_waits: int = 0  # sends that found kvindex's buffers full and waited (back-pressure)
    send_s: float = 0.0


def _new_xpub(ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    # XPUB_NODROP: a full pipe makes send raise EAGAIN instead of dropping, so every frame sent arrives
    # and the drop counts can be checked exactly; the sender waits (counted as send_waits) instead.
    sock: zmq.Socket[bytes] = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.LINGER, 60_000)
    return sock


def _wait_serving(router: GarbageRouter | None, source: zmq.Socket[bytes] | int, timeout_s: float) -> bool:
    """Wait until `source` (a socket, or the parent pipe's fd) is readable, answering replay requests
    meanwhile (kvindex's worker waits for those answers); False on timeout."""
    poller = zmq.Poller()
    poller.register(source, zmq.POLLIN)
    if router is not None:
        poller.register(router.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(remaining * 1000) + 1))
        if router is not None and router.sock in ready:
            router.serve()
        if source in ready:
            return True
    return False


def _await_subscription(sock: zmq.Socket[bytes], router: GarbageRouter | None) -> None:
    if not _wait_serving(router, sock, 60.0):
        raise TimeoutError("kvindex's SUB never subscribed")
    sock.recv()


def _restart_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    sock: zmq.Socket[bytes],
    endpoint: str,
    mode: str,
    router: GarbageRouter | None,
) -> zmq.Socket[bytes]:
    """A hostile engine goes and comes back: bound again on its address (connect mode: kvindex dials it
    again) or a new connection to kvindex's (bind mode). The old socket lingers until what it holds is
    sent."""
    sock.close(linger=60_000)
    new = _new_xpub(ctx)
    if mode == "bind":
        new.connect(endpoint)
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                new.bind(endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                _wait_serving(router, new, 0.05)  # the old listener is released asynchronously
    _await_subscription(new, router)
    return new


def hostile_main(conn: multiprocessing.connection.Connection, plan_builtins: dict[str, Any]) -> None:
    """The hostile senders, in their own process (spawned: no state shared with kvindex's)."""
    plan = msgspec.convert(plan_builtins, HostilePlan)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        _hostile_run(conn, plan, ctx)
    finally:
        ctx.destroy(linger=0)


def _hostile_run(
    conn: multiprocessing.connection.Connection, plan: HostilePlan, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    corpus = load_corpus()
    fuzzer = Fuzzer(plan.seed, corpus, plan.mode, victims=plan.victims, good_pod_ids=plan.good_pod_ids)
    report = HostileReport()
    expected: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    router: GarbageRouter | None = None
    sockets: list[zmq.Socket[bytes]] = []
    if plan.mode == "connect":
        pods = []
        for pod_id in CONNECT_HOSTILE_PODS:
            sock = _new_xpub(ctx)
            sock.bind("tcp://127.0.0.1:0")
            sockets.append(sock)
            replay = None
            if pod_id == "hostile-router":
                router_sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
                router_sock.setsockopt(zmq.LINGER, 0)
                router_sock.bind("tcp://127.0.0.1:0")
                replay = router_sock.getsockopt_string(zmq.LAST_ENDPOINT)
                router = GarbageRouter(
                    router_sock,
                    random.Random(plan.seed + 1),
                    corpus,
                    expected,
                    max_silences=max_router_silences(plan.num_frames),
                )
            pods.append((pod_id, sock.getsockopt_string(zmq.LAST_ENDPOINT), replay))
        conn.send(pods)
        endpoints = [endpoint for _, endpoint, _ in pods]
    else:
        listen: str = conn.recv()
        endpoints = [listen] * NUM_BIND_SOCKETS
        for _ in range(NUM_BIND_SOCKETS):
            sock = _new_xpub(ctx)
            sock.connect(listen)
            sockets.append(sock)

    def serve() -> None:
        if router is not None:
            router.serve()

    for sock in sockets:
        _await_subscription(sock, router)
    conn.send("subscribed")
    _wait_serving(router, conn.fileno(), 600.0)
    if conn.recv() != "go":
        return

    router_target = len(CONNECT_HOSTILE_PODS) - 1
    restart_at = {plan.num_frames * (i + 1) // (NUM_RESTARTS + 1) for i in range(NUM_RESTARTS)}
    start = time.perf_counter()
    sent = 0
    while sent < plan.num_frames:
        chunk = [fuzzer.message() for _ in range(min(SEND_CHUNK, plan.num_frames - sent))]
        for message in chunk:
            if sent in restart_at:
                index = sent % len(sockets)
                sockets[index] = _restart_socket(ctx, sockets[index], endpoints[index], plan.mode, router)
                if plan.mode == "connect":
                    fuzzer.restart(index)  # its seqs start at 0 again (bind mode: per topic, they go on)
            frames = message.frames
            kinds[message.kind] += 1
            kinds.update(message.extra)
            reason = expected_intake_drop(plan.mode, frames, MODEL_NAMES)
            if reason is not None:
                expected[reason] += 1
            else:
                report.to_worker += 1
                readable = payload_drops(frames[2], expected)
                if router is not None and message.target == router_target and readable:
                    router.ring.append((int.from_bytes(frames[1], "big"), frames[2]))
            sock = sockets[message.target]
            while True:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    report.send_waits += 1
                    serve()
                    time.sleep(0.0002)  # ok: back-pressure, kvindex's buffers are full
            sent += 1
            serve()
    report.send_s = time.perf_counter() - start
    report.sent = sent
    report.kinds = dict(kinds)
    conn.send("sent")
    # Until the parent has settled: the ROUTER keeps answering (kvindex probes quiet pods); each
    # "report" request gets the tallies so far.
    while True:
        _wait_serving(router, conn.fileno(), 3600.0)
        request = conn.recv()
        if request != "report":
            break
        report.expected_dropped = dict(expected)
        if router is not None:
            report.replay_requests, report.replay_silences = router.requests, router.silences
        conn.send(msgspec.to_builtins(report))


# --- the good engines ------------------------------------------------------------------------------------


class GoodEngine:
    """A well-behaved engine: a real EventPublisher (PUB + replay ring) and what it holds (the reference,
    by the event rules: stored adds, removed drops, cleared empties)."""

    def __init__(
        self,
        engine_no: int,
        pod_id: str,
        endpoint: str,
        *,
        replay_endpoint: str,
        topic: str,
        ctx: zmq.Context[zmq.Socket[bytes]],
    ) -> None:
        self.engine_no = engine_no
        self.ref = PodRef(pod_id, 0)
        self.hasher = good_hasher()
        self.publisher = EventPublisher(endpoint, replay_endpoint=replay_endpoint, topic=topic, ctx=ctx)
        self.held: set[int] = set()
        self.ever: set[int] = set()
        self._stored: deque[list[int]] = deque()
        self._batch_no = 0
        self._lock = threading.Lock()

    def store(self) -> None:
        with self._lock:
            tokens = good_tokens(self.engine_no, self._batch_no)
            keys = self.hasher.event_hashes(tokens)
            self._batch_no += 1
            self.publisher.publish([block_stored(keys, None, tokens=tokens)], data_parallel_rank=0)
            self.held.update(keys)
            self.ever.update(keys)
            self._stored.append(keys)

    def step(self, rng: random.Random) -> None:
        """One engine step: mostly stores, some evictions of the oldest prompt, a rare cache reset."""
        roll = rng.random()
        if roll < 0.65 or not self.held:
            self.store()
            return
        with self._lock:
            if roll < 0.97:
                while self._stored and not self.held.intersection(self._stored[0]):
                    self._stored.popleft()
                keys = [k for k in self._stored.popleft() if k in self.held]
                self.publisher.publish([block_removed(keys)])
                self.held.difference_update(keys)
            else:
                self.publisher.publish([AllBlocksCleared()])
                self.held.clear()
                self._stored.clear()

    def close(self) -> None:
        self.publisher.close()


def indexed_keys(index: KVIndex, pod: PodRef, universe: set[int]) -> set[int]:
    """The keys among `universe` the index says `pod` holds (any tier)."""
    held = set()
    for key in universe:
        holders = index.lookup([key])
        if holders and any(entry_pod == pod for entry_pod, _ in holders[0]):
            held.add(key)
    return held


def good_pods_exact(index: KVIndex, engines: Sequence[GoodEngine], universe: set[int]) -> bool:
    """Each good pod holds exactly its engine's blocks: none missing, none extra (on any tier)."""
    return all(
        indexed_keys(index, e.ref, universe) == e.held and index.pod_block_count(e.ref) == len(e.held)
        for e in engines
    )


# --- the harness -----------------------------------------------------------------------------------------


class _LogTally(logging.Handler):
    """Counts kvindex's log records by level, and exceptions that reached a catch-all by signature
    (without printing them: a fuzz run logs hundreds of thousands of warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.levels: Counter[str] = Counter()
        self.exceptions: Counter[str] = Counter()
        self.tracebacks: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.levels[record.levelname] += 1
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            where = traceback.extract_tb(exc.__traceback__)[-1]
            signature = f"{type(exc).__name__} at {Path(where.filename).name}:{where.lineno} ({where.name})"
            self.exceptions[signature] += 1
            if signature not in self.tracebacks:
                self.tracebacks[signature] = "".join(traceback.format_exception(exc)).rstrip()


class ModeResult(msgspec.Struct):
    mode: str
    frames_sent: int = 0
    good_sent: int = 0
    seen: int = 0  # messages the subscriber read (hostile and good)
    wall_s: float = 0.0  # the whole mode: processes, sockets, joins, checks
    ingest_s: float = 0.0  # from the first hostile frame until everything sent was seen and applied
    send_s: float = 0.0
    send_waits: int = 0
    kinds: dict[str, int] = {}
    dropped: dict[str, int] = {}
    expected_dropped: dict[str, int] = {}
    to_worker: int = 0
    good_exact: bool = False
    threads_alive: bool = False
    dead_threads: int = 0  # crashes: service threads that died (this process itself is alive to say so)
    exceptions: dict[str, int] = {}
    tracebacks: dict[str, str] = {}
    log_levels: dict[str, int] = {}
    counters: dict[str, Any] = {}
    num_streams: int = 0
    rss_mb: float = 0.0  # this process (kvindex and the good engines) once everything was applied
    replay_requests: int = 0
    replay_silences: int = 0
    failures: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.failures


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _await(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)  # ok: polling a condition under a deadline


def _recv(conn: multiprocessing.connection.Connection, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the hostile process sent no {what} within {timeout_s:.0f} s")
    return conn.recv()


def _await_sent(conn: multiprocessing.connection.Connection, subscriber: Subscriber) -> None:
    """Wait for the hostile process to finish sending, unless kvindex stops reading meanwhile."""
    last_count, last_change = subscriber.num_messages, time.monotonic()
    while not conn.poll(1.0):
        if subscriber.num_messages != last_count:
            last_count, last_change = subscriber.num_messages, time.monotonic()
        elif time.monotonic() - last_change > STALL_TIMEOUT_S:
            raise TimeoutError(
                f"the subscriber read nothing for {STALL_TIMEOUT_S:.0f} s while frames were sent"
            )
    conn.recv()


def _dead_threads(service: IngestService) -> int:
    """How many of the service's own threads (poller, replay fetcher, workers, watch) are not running
    (read through its private handles: not part of IngestView)."""
    threads = [
        service._subscriber._thread,
        service._fetcher._thread,
        *service._queues._threads,
        service._watch_thread,
    ]
    return sum(1 for thread in threads if thread is None or not thread.is_alive())


def _bind_engine(engine_no: int, listen: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> GoodEngine:
    """A good engine dialling kvindex; its pod id is its replay port, so PORT_TEMPLATE reaches it."""
    for _ in range(19):
        port = _free_port()
        try:
            return GoodEngine(
                engine_no,
                str(port),
                listen,
                replay_endpoint=f"tcp://127.0.0.1:{port}",
                topic=f"kv@{port}@{MODEL}",
                ctx=ctx,
            )
        except zmq.ZMQError as exc:  # the port was taken again in between: another one
            if exc.errno != zmq.EADDRINUSE:
                raise
    raise RuntimeError("no free port for a good engine's replay socket")


def run_mode(
    mode: str,
    num_frames: int,
    seed: int,
    *,
    bind_replay_template: str | None = PORT_TEMPLATE,
    log: Callable[[str], None] = lambda _: None,
) -> ModeResult:
    """One mode: hostile frames from a spawned process beside good engines, then the checks."""
    result = ModeResult(mode=mode)
    tally = _LogTally()
    kv_logger = logging.getLogger("kvindex")
    kv_logger.addHandler(tally)
    # Hundreds of thousands of warnings: counted here, not printed (or kept by pytest's log capture).
    propagate, kv_logger.propagate = kv_logger.propagate, False
    mp = multiprocessing.get_context("spawn")
    conn, child_conn = mp.Pipe()
    victims = victim_keys()
    good_ids = tuple(f"good-{i}" for i in range(NUM_GOOD_PODS)) if mode == "connect" else ()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines: list[GoodEngine] = []
    service: IngestService | None = None
    child: BaseProcess | None = None
    start = time.perf_counter()
    try:
        settings = IngestSettings(listen_replay_template=bind_replay_template)
        models = [ModelConfig(name=name, block_size=BLOCK_SIZE) for name in MODEL_NAMES]
        if mode == "connect":
            engines = [
                GoodEngine(
                    i,
                    good_ids[i],
                    "tcp://127.0.0.1:0",
                    replay_endpoint="tcp://127.0.0.1:0",
                    topic="",
                    ctx=ctx,
                )
                for i in range(NUM_GOOD_PODS)
            ]
            plan = HostilePlan(mode, seed, num_frames, good_ids, tuple(victims))
            child = mp.Process(target=hostile_main, args=(child_conn, msgspec.to_builtins(plan)), daemon=True)
            child.start()
            hostile_pods: list[tuple[str, str, str | None]] = _recv(conn, 60, "endpoints")
            pods = [
                PodConfig(e.ref.pod_id, e.publisher.endpoint, MODEL, e.publisher.replay_endpoint)
                for e in engines
            ]
            pods += [PodConfig(pod_id, endpoint, MODEL, replay) for pod_id, endpoint, replay in hostile_pods]
            service = IngestService(models, pods, settings=settings)
            service.start()
        else:
            service = IngestService(models, listen="tcp://127.0.0.1:*", settings=settings)
            service.start()
            listen = service.listen_endpoint
            assert listen is not None
            engines = [_bind_engine(i, listen, ctx) for i in range(NUM_GOOD_PODS)]
            plan = HostilePlan(mode, seed, num_frames, tuple(e.ref.pod_id for e in engines), tuple(victims))
            child = mp.Process(target=hostile_main, args=(child_conn, msgspec.to_builtins(plan)), daemon=True)
            child.start()
            conn.send(service.listen_endpoint)
        index = service.model(MODEL).index  # type: ignore[union-attr]
        live_service = service
        stored_at = dict.fromkeys(engines, 0.0)

        def good_pods_joined() -> bool:
            statuses = {(s.pod, s.dp_rank): s for s in live_service.pod_statuses()}
            joined = True
            for engine in engines:
                status = statuses.get((engine.ref.pod_id, 0))
                if status is None or status.state != "live" or status.last_seq != engine.publisher.last_seq:
                    joined = False
                    # Until the subscription is up a PUB drops everything (the ring replays it later):
                    # publish again now and then until a batch gets through.
                    if time.monotonic() - stored_at[engine] > 0.5:
                        stored_at[engine] = time.monotonic()
                        engine.store()
            return joined

        _await(good_pods_joined, 60, "the good pods to join")
        if _recv(conn, 60, "subscription notice") != "subscribed":
            raise RuntimeError("the hostile process did not subscribe")
        # From here every message sent must be seen: what the good engines sent so far was seen or replayed.
        subscriber = service._subscriber  # the poller's own message count (not part of IngestView)
        seen_before = subscriber.num_messages
        good_sent_before = sum(e.publisher.sent_count for e in engines)
        log(f"{mode}: sending {num_frames:,} hostile frames")
        stop = threading.Event()
        driver_rng = random.Random(seed + 2)

        def drive_good_engines() -> None:
            while not stop.wait(GOOD_INTERVAL_S):
                driver_rng.choice(engines).step(driver_rng)

        driver = threading.Thread(target=drive_good_engines, name="fuzz-good-engines", daemon=True)
        flood_start = time.perf_counter()
        driver.start()
        conn.send("go")
        _await_sent(conn, subscriber)
        stop.set()
        driver.join()
        log(f"{mode}: sent in {time.perf_counter() - flood_start:.1f} s; settling")
        # Still ingesting: one more good batch each, then everything sent must be seen and applied.
        for engine in engines:
            engine.store()
            engine.publisher.flush(10)
        result.good_sent = sum(e.publisher.sent_count for e in engines) - good_sent_before

        def settled() -> bool:
            return subscriber.num_messages - seen_before >= num_frames + result.good_sent and all(
                live_service.applied_seqs().get(e.ref) == e.publisher.last_seq for e in engines
            )

        try:
            _await(settled, SETTLE_TIMEOUT_S, "every frame seen and the good pods' last batches applied")
        except TimeoutError as exc:
            result.failures.append(str(exc))
        result.ingest_s = time.perf_counter() - flood_start
        universe = set().union(*(e.ever for e in engines), victims)
        try:  # a worker may still be applying what it gathered with the last batch
            _await(lambda: good_pods_exact(index, engines, universe), 10, "the good pods' entries")
            result.good_exact = True
        except TimeoutError:
            result.good_exact = False
        result.dead_threads = _dead_threads(service)
        result.threads_alive = not result.dead_threads
        # The drop counts must equal the hostile side's tallies; a probe replay may be in flight.
        deadline = time.monotonic() + 30
        while True:
            before = service.counters()
            conn.send("report")
            report = msgspec.convert(_recv(conn, 60, "report"), HostileReport)
            counters = service.counters()
            settled_drops = not drop_mismatches(counters.dropped, report.expected_dropped)
            if (counters == before and settled_drops) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # ok: let an in-flight replay finish, then compare again
        result.wall_s = time.perf_counter() - start
        result.seen = subscriber.num_messages - seen_before
        result.frames_sent = report.sent
        result.send_s = report.send_s
        result.send_waits = report.send_waits
        result.kinds = report.kinds
        result.to_worker = report.to_worker
        result.expected_dropped = report.expected_dropped
        result.replay_requests, result.replay_silences = report.replay_requests, report.replay_silences
        result.dropped = counters.dropped
        result.counters = msgspec.to_builtins(counters)
        result.num_streams = len(service.pod_statuses())
        result.rss_mb = _rss_bytes() / 2**20
        _check(result)
    finally:
        if child is not None:
            if child.is_alive():
                try:
                    conn.send("close")
                except OSError:
                    pass
            child.join(30)
            if child.is_alive():
                child.kill()
        if service is not None:
            service.stop()
        for engine in engines:
            engine.close()
        ctx.destroy(linger=0)
        kv_logger.removeHandler(tally)
        kv_logger.propagate = propagate
        result.exceptions = dict(tally.exceptions)
        result.tracebacks = dict(tally.tracebacks)
        result.log_levels = dict(tally.levels)
        if tally.exceptions:
            result.failures.append(f"exceptions reached a catch-all: {dict(tally.exceptions)}")
    return result


def drop_mismatches(dropped: dict[str, int], expected: dict[str, int]) -> list[str]:
    """What is wrong with the service's drop counts against the hostile side's tally ([]: nothing).

    Exact, but for one reason: a worker queue that stays full for queue_full_wait_s makes the poller drop
    messages under `queue_full` (counted, as the rules want). It also counts dropped quiet probes, so it
    is not compared itself; when it is non-zero the other reasons may fall short, by no more batches
    (the batch-level decode_* reasons) than it counts.
    """
    queue_full = dropped.get("queue_full", 0)
    problems = []
    missing_batches = 0
    for reason in sorted((set(dropped) | set(expected)) - {"queue_full"}):
        got, want = dropped.get(reason, 0), expected.get(reason, 0)
        if got > want or (got < want and not queue_full):
            problems.append(f"dropped[{reason}] = {got:,}, the frames sent deserve {want:,}")
        elif reason.startswith("decode_"):
            missing_batches += want - got
    if missing_batches > queue_full:
        problems.append(f"{missing_batches:,} unreadable batches not counted, only {queue_full:,} queue_full")
    return problems


def _check(result: ModeResult) -> None:
    failures = result.failures
    if not result.threads_alive:
        failures.append("an ingest thread died")
    if not result.good_exact:
        failures.append("a good pod's index entries differ from what its engine holds")
    lost = result.frames_sent + result.good_sent - result.seen
    if lost:
        failures.append(f"{lost:,} messages sent and not seen by the subscriber (negative: seen, not sent)")
    if not sum(result.dropped.values()):
        failures.append("nothing was counted as dropped")
    failures += drop_mismatches(result.dropped, result.expected_dropped)


# --- the command -----------------------------------------------------------------------------------------


def _fmt(n: int) -> str:
    return f"{n:,}"


def summary_table(results: Sequence[ModeResult]) -> str:
    rows: list[list[object]] = []
    for r in results:
        rows.append(
            [
                r.mode,
                _fmt(r.frames_sent),
                _fmt(r.good_sent),
                _fmt(r.seen),
                _fmt(r.frames_sent + r.good_sent - r.seen),
                _fmt(r.send_waits),
                _fmt(r.num_streams),
                f"{r.rss_mb:,.0f}",
                "yes" if r.good_exact else "NO",
                _fmt(r.dead_threads),
                _fmt(sum(r.exceptions.values())),
                _fmt(round(r.frames_sent / r.ingest_s)) if r.ingest_s else "-",
                f"{r.ingest_s:.1f}",
                f"{r.wall_s:.1f}",
            ]
        )
    headers = [
        "mode", "hostile sent", "good sent", "seen by SUB", "lost", "send waits", "streams", "RSS MB",
        "good exact", "crashes", "escaped exceptions", "frames/s", "ingest s", "wall s",
    ]  # fmt: skip
    return format_table(headers, rows)


def drops_table(results: Sequence[ModeResult]) -> str:
    reasons = sorted({reason for r in results for reason in (*r.dropped, *r.expected_dropped)})
    rows: list[list[object]] = []
    for reason in reasons:
        row: list[object] = [reason]
        for r in results:
            got, want = r.dropped.get(reason, 0), r.expected_dropped.get(reason, 0)
            row += [_fmt(got), "=" if got == want else "" if reason == "queue_full" else f"{got - want:+,}"]
        rows.append(row)
    headers = ["dropped by reason"]
    for r in results:
        headers += [r.mode, "check"]
    return format_table(headers, rows)


def counters_table(results: Sequence[ModeResult]) -> str:
    names = ("gaps", "duplicates", "history_lost", "restarts", "hash_mismatches", "block_size_mismatches",
             "non_prefix_group_events", "unknown_parents")  # fmt: skip
    rows: list[list[object]] = []
    for name in names:
        rows.append([name, *(_fmt(int(r.counters.get(name, 0))) for r in results)])
    for table in ("events_applied", "replays"):
        keys = sorted({k for r in results for k in r.counters.get(table, {})})
        for key in keys:
            rows.append([f"{table}[{key}]", *(_fmt(r.counters.get(table, {}).get(key, 0)) for r in results)])
    rows.append(["frames past intake", *(_fmt(r.to_worker) for r in results)])
    rows.append(
        [
            "garbage ROUTER requests / silences",
            *(f"{r.replay_requests} / {r.replay_silences}" for r in results),
        ]
    )
    rows.append(["kvindex warnings logged", *(_fmt(r.log_levels.get("WARNING", 0)) for r in results)])
    return format_table(["counter", *(r.mode for r in results)], rows)


def kinds_table(results: Sequence[ModeResult]) -> str:
    kinds = sorted({k for r in results for k in r.kinds}, key=lambda k: (k not in PAYLOAD_KINDS, k))
    rows = [[kind, *(_fmt(r.kinds.get(kind, 0)) for r in results)] for kind in kinds]
    return format_table(["mutation", *(r.mode for r in results)], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--frames", type=int, default=1_000_000, help="hostile frames in all (split over modes)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=("connect", "bind", "both"), default="both")
    parser.add_argument(
        "--no-bind-replay",
        action="store_true",
        help=f"bind mode without --listen-replay (default: the template {PORT_TEMPLATE})",
    )
    parser.add_argument("--quick", action="store_true", help="20,000 frames (smoke test)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    num_frames = 20_000 if args.quick else args.frames
    modes = ("connect", "bind") if args.mode == "both" else (args.mode,)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = []
    for i, mode in enumerate(modes):
        share = num_frames // len(modes) + (1 if i < num_frames % len(modes) else 0)
        template = None if args.no_bind_replay else PORT_TEMPLATE
        results.append(run_mode(mode, share, args.seed + i, bind_replay_template=template, log=log))
    print(f"fuzz: {num_frames:,} hostile frames, seed {args.seed}, {os.cpu_count()} CPUs")
    print(summary_table(results))
    print()
    print(drops_table(results))
    print()
    print(counters_table(results))
    print()
    print(kinds_table(results))
    for r in results:
        for signature, text in r.tracebacks.items():
            print(f"\n{r.mode}: {r.exceptions[signature]:,} x {signature}\n{text}")
    failures = [f"{r.mode}: {failure}" for r in results for failure in r.failures]
    print("\n" + ("\n".join(failures) if failures else "all checks passed"))
    if args.json is not None:
        args.json.write_text(json.dumps([msgspec.to_builtins(r) for r in results], indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
