"""kvindex vs NVIDIA Dynamo's indexer on identical vLLM KV-event bytes: ingest, score latency, memory, scale.

Both services are real processes on 127.0.0.1 fed by a separate publisher process each (one XPUB per
engine, pre-encoded vLLM 0.33 payloads from benchmarks/workload.py), on the same bytes. Each ingests alone
while the other idles (sequential is fairer on a small box than both at once); their idle score latencies
are then timed request by request in turn, so a stall of the shared box meets both alike. Timings use one
lean HTTP client (benchmarks/service.py TimedClient) for both: first byte sent to last byte received,
the answer decoded and checked outside that window. Dynamo is optional: without it only kvindex's
column is filled.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from benchmarks.dynamo import DynamoIndexer, dynamo_local_hashes
from benchmarks.floor import FloorServer
from benchmarks.service import (
    JsonClient,
    KvindexService,
    TimedClient,
    blocks_per_engine_dynamo,
    blocks_per_engine_kvindex,
)
from benchmarks.workload import ScoreQuery, WorkloadSpec, build_payloads, build_workload, encode_engine

POLL_S = 0.05  # same completion-poll interval for both services
FLOOR = "floor"  # the results' name of the FloorServer's idle latencies (it ingests nothing)
# Requests of each kind timed under ingest per service and round (_time_during_ingest), and how many
# rounds of publishing it may take to reach them.
DURING_MIN_SAMPLES = 200
DURING_MAX_ROUNDS = 16


@dataclass(frozen=True)
class Feed:
    """What every service under test is fed: per engine the payload of seq k at [k]; the score prompts."""

    spec: WorkloadSpec
    payloads: list[list[bytes]]
    num_events: int
    num_blocks: int
    queries: list[ScoreQuery]


# --- the publisher process -------------------------------------------------------------------------


def _publisher_main(conn: multiprocessing.connection.Connection, payloads: list[list[bytes]]) -> None:
    """Child process: bind one XPUB per engine, then obey ("await", timeout) / ("publish", round) / ("stop")."""
    import zmq

    parent = os.getppid()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 65_536)
    sockets: list[Any] = []
    try:
        for _ in payloads:
            sock = ctx.socket(zmq.XPUB)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop at our end: a slow subscriber is the thing measured
            sock.setsockopt(zmq.RCVTIMEO, 100)
            sock.bind("tcp://127.0.0.1:0")
            sockets.append(sock)
        conn.send([sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in sockets])
        while os.getppid() == parent:
            if not conn.poll(0.5):
                continue
            command, arg = conn.recv()
            if command == "stop":
                break
            if command == "await":
                conn.send(_await_subscribers(sockets, float(arg)))
            elif command == "publish":
                conn.send(_publish_round(sockets, payloads, int(arg)))
    except (KeyboardInterrupt, BrokenPipeError, EOFError):
        pass
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def _await_subscribers(sockets: list[Any], timeout_s: float) -> tuple[str, str]:
    import zmq

    deadline = time.monotonic() + timeout_s
    for index, sock in enumerate(sockets):
        while True:
            try:
                if sock.recv()[:1] == b"\x01":
                    break
            except zmq.Again:
                if time.monotonic() > deadline:
                    return "error", f"engine {index}: no subscriber after {timeout_s:.0f}s"
    return "ok", ""


def _publish_round(
    sockets: list[Any], payloads: list[list[bytes]], round_index: int
) -> tuple[str, float, float]:
    """Every engine's payloads, round-robin across engines; seq continues across rounds."""
    first = time.monotonic()
    for k in range(max(len(p) for p in payloads)):
        for sock, engine_payloads in zip(sockets, payloads, strict=True):
            if k < len(engine_payloads):
                seq = round_index * len(engine_payloads) + k
                sock.send_multipart([b"", seq.to_bytes(8, "big"), engine_payloads[k]])
    return "published", first, time.monotonic()


class Publishers:
    """The publisher process; a context manager that always ends it."""

    def __init__(self, payloads: list[list[bytes]]) -> None:
        self.payloads = payloads
        # fork: the child inherits the (large) payload list without pickling it.
        context = multiprocessing.get_context("fork")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_publisher_main, args=(child_conn, payloads), daemon=True)
        self.endpoints: list[str] = []

    def __enter__(self) -> Publishers:
        self._process.start()
        self.endpoints = self._recv(60.0)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._conn.send(("stop", None))
        except OSError:
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"publisher process silent for {timeout_s:.0f}s")
        return self._conn.recv()

    def await_subscribers(self, timeout_s: float = 60.0) -> None:
        self._conn.send(("await", timeout_s))
        status, message = self._recv(timeout_s + 30)
        if status != "ok":
            raise TimeoutError(message)

    def start_round(self, round_index: int) -> None:
        self._conn.send(("publish", round_index))

    def finish_round(self, timeout_s: float = 600.0) -> tuple[float, float]:
        """(monotonic time of the first send, of the last send) of the round started last."""
        _, first, last = self._recv(timeout_s)
        return first, last

    def last_seqs(self, round_index: int) -> dict[int, int]:
        return {engine: (round_index + 1) * len(p) - 1 for engine, p in enumerate(self.payloads)}


# --- the services under test, behind one small interface -------------------------------------------


class Subject(Protocol):
    name: str
    port: int
    pid: int  # the service's process

    def caught_up(self, round_index: int) -> bool: ...
    def progress(self) -> str: ...
    def rss_bytes(self) -> int: ...
    def token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]: ...
    def full_token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]: ...
    def hash_request(self, token_ids: Sequence[int], event_hashes: Sequence[int]) -> tuple[str, bytes]: ...
    def blocks_per_engine(self, response: Any) -> dict[int, int]: ...


class KvindexSubject:
    name = "kvindex"

    def __init__(self, service: KvindexService, publishers: Publishers, events_per_round: int) -> None:
        self.service = service
        self.publishers = publishers
        self.events_per_round = events_per_round
        self.port = service.port
        self.pid = service.pid

    def caught_up(self, round_index: int) -> bool:
        # Dynamo's criterion (events applied, one counter), read from /v1/ingest: polling /v1/pods at
        # 1,000 pods cost the service ~2 ms of GIL and this client ~5 ms of json.loads every 50 ms, on
        # the two cores being measured. A duplicate is skipped, never applied, so the count is reached
        # when every pod's last seq is (and the score answers that follow are checked).
        return self.service.events_applied() >= (round_index + 1) * self.events_per_round

    def progress(self) -> str:
        pods = self.service.pods()
        states = sorted({pod["state"] for pod in pods})
        return f"sum of last_seq {sum(pod['last_seq'] or 0 for pod in pods)}, pod states {states}"

    def rss_bytes(self) -> int:
        return self.service.rss_bytes()

    # The compact answer ([pod, dp_rank, matched_blocks, score] per pod) is what a router asks for, and what
    # Dynamo answers (tokens per worker and rank); the full answer's ~150 B per pod (by_tier, health) cost
    # the client's json.loads ~130 us per 100 pods, more than kvindex's whole handler. The full answer is
    # timed as its own row (full_token_request).
    def token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]:
        return "/v1/score", self.service.score_body(token_ids=token_ids, answer="compact")

    def full_token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]:
        return "/v1/score", self.service.score_body(token_ids=token_ids)

    def hash_request(self, token_ids: Sequence[int], event_hashes: Sequence[int]) -> tuple[str, bytes]:
        return "/v1/score", self.service.score_body(block_hashes=event_hashes, answer="compact")

    def blocks_per_engine(self, response: Any) -> dict[int, int]:
        return blocks_per_engine_kvindex(response)


class DynamoSubject:
    name = "Dynamo"

    def __init__(self, indexer: DynamoIndexer, events_per_round: int) -> None:
        self.indexer = indexer
        self.events_per_round = events_per_round
        self.port = indexer.port
        self.pid = indexer.pid

    def caught_up(self, round_index: int) -> bool:
        return sum(self.indexer.events_applied().values()) >= (round_index + 1) * self.events_per_round

    def progress(self) -> str:
        return f"events applied {self.indexer.events_applied()}"

    def rss_bytes(self) -> int:
        return self.indexer.rss_bytes()

    def token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]:
        body = {"token_ids": list(token_ids), "model_name": self.indexer.model_name}
        return "/query", json.dumps(body).encode()

    def full_token_request(self, token_ids: Sequence[int]) -> tuple[str, bytes]:
        return self.token_request(token_ids)  # Dynamo has one answer shape

    def hash_request(self, token_ids: Sequence[int], event_hashes: Sequence[int]) -> tuple[str, bytes]:
        # Dynamo cannot take vLLM's event hashes; a router would hold Dynamo's own, so they are precomputed.
        local = dynamo_local_hashes(token_ids, self.indexer.block_size)
        body = {"block_hashes": local, "model_name": self.indexer.model_name}
        return "/query_by_hash", json.dumps(body).encode()

    def blocks_per_engine(self, response: Any) -> dict[int, int]:
        return blocks_per_engine_dynamo(response, self.indexer.block_size)


@contextmanager
def start_subject(
    kind: str, publishers: Publishers, feed: Feed, serve_args: Sequence[str] = ()
) -> Iterator[Subject]:
    """`serve_args`: more `kvindex serve` flags for a kvindex subject (e.g. `--store URL`)."""
    spec = feed.spec
    if kind.startswith("kvindex"):
        with KvindexService(
            publishers.endpoints, hash_seed=spec.hash_seed, block_size=spec.block_size, extra_args=serve_args
        ) as svc:
            try:
                if serve_args:
                    _await_owned(svc)
                yield KvindexSubject(svc, publishers, feed.num_events)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; kvindex log: {svc.log_tail(1500)}") from exc
    else:
        workers = {index + 1: endpoint for index, endpoint in enumerate(publishers.endpoints)}
        startup_s = 60.0 + len(workers) * 0.2
        with DynamoIndexer(workers, block_size=spec.block_size, startup_timeout_s=startup_s) as indexer:
            try:
                yield DynamoSubject(indexer, feed.num_events)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; Dynamo log: {indexer.log_tail(1500)}") from exc


def _await_owned(service: KvindexService, timeout_s: float = 60.0) -> None:
    """With a shared store, a replica ingests a pod once it holds the pod's lease; the benchmark's
    publishers keep no ring to rejoin from, so publishing waits until every pod is owned."""
    deadline = time.monotonic() + timeout_s
    while any(pod.get("owner") is None for pod in service.pods()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every pod owned within {timeout_s:.0f}s")
        time.sleep(POLL_S)  # ok: polling with a deadline


# --- measurements -------------------------------------------------------------------------------


@dataclass
class Latencies:
    samples_s: list[float] = field(default_factory=list)
    checked: int = 0
    correct: int = 0

    def percentile_ms(self, fraction: float) -> float | None:
        if not self.samples_s:
            return None
        ordered = sorted(self.samples_s)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3

    def add(self, other: Latencies) -> None:
        """Pool `other`'s samples and checks into these."""
        self.samples_s.extend(other.samples_s)
        self.checked += other.checked
        self.correct += other.correct

    def summary(self) -> dict[str, Any]:
        return {
            "count": len(self.samples_s),
            "p50_ms": self.percentile_ms(0.5),
            "p99_ms": self.percentile_ms(0.99),
            "checked": self.checked,
            "correct": self.correct,
        }


@dataclass
class SubjectResult:
    name: str
    pairs: int
    ingest_s: float | None = None
    publish_s: float | None = None
    rss_before: int | None = None
    rss_after: int | None = None
    idle: dict[str, Latencies] = field(default_factory=dict)
    during: dict[str, Latencies] = field(default_factory=dict)
    during_ingest_s: float | None = None
    error: str | None = None

    @property
    def blocks_per_s(self) -> float | None:
        return self.pairs / self.ingest_s if self.ingest_s else None

    @property
    def bytes_per_pair(self) -> float | None:
        if self.rss_before is None or self.rss_after is None:
            return None
        return (self.rss_after - self.rss_before) / self.pairs

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pairs": self.pairs,
            "ingest_s": self.ingest_s,
            "publish_s": self.publish_s,
            "blocks_per_s": self.blocks_per_s,
            "rss_before": self.rss_before,
            "rss_after": self.rss_after,
            "bytes_per_pair": self.bytes_per_pair,
            "idle": {kind: lat.summary() for kind, lat in self.idle.items()},
            "during": {kind: lat.summary() for kind, lat in self.during.items()},
            "during_ingest_s": self.during_ingest_s,
            "error": self.error,
        }


def await_ingest(subject: Subject, round_index: int, timeout_s: float, stall_s: float = 60.0) -> None:
    """Return once `subject` has ingested round `round_index`; fail early (with its state) if it makes no
    progress for `stall_s` — e.g. messages dropped with no replay to repair them."""
    deadline = time.monotonic() + timeout_s
    last_progress, last_change = "", time.monotonic()
    while not subject.caught_up(round_index):
        now = time.monotonic()
        if now - last_change > 5.0 or not last_progress:
            progress = subject.progress()
            if progress != last_progress:
                last_progress, last_change = progress, now
            elif now - last_change > stall_s:
                raise TimeoutError(f"{subject.name} stalled for {stall_s:.0f}s before ingesting: {progress}")
        if now > deadline:
            raise TimeoutError(f"{subject.name} did not ingest round {round_index} in {timeout_s:.0f}s")
        time.sleep(POLL_S)  # ok: polling with a deadline


def _timed_post(client: TimedClient, path: str, body: bytes) -> tuple[float, Any]:
    """The round trip's seconds, and the answer decoded after it."""
    elapsed, data = client.post(path, body)
    return elapsed, json.loads(data)


def _requests(subject: Subject, feed: Feed, kinds: Sequence[str]) -> dict[str, list[tuple[str, bytes]]]:
    made: dict[str, list[tuple[str, bytes]]] = {}
    for kind in kinds:
        if kind == "tokens":
            made[kind] = [subject.token_request(q.token_ids) for q in feed.queries]
        elif kind == "tokens_full":
            made[kind] = [subject.full_token_request(q.token_ids) for q in feed.queries]
        else:
            made[kind] = [subject.hash_request(q.token_ids, q.event_hashes) for q in feed.queries]
    return made


def time_queries_during(
    subject: Subject,
    feed: Feed,
    requests: dict[str, list[tuple[str, bytes]]],
    keep_going: Callable[[], bool],
    max_rounds: int,
) -> dict[str, Latencies]:
    """Time every request (kinds interleaved) and check each answer against the brute-force overlaps,
    cycling through the queries (at most `max_rounds` times) while `keep_going` stays true, asked every 10
    queries: samples only while an ingest round is still running (no warm-up: a request stalled behind
    ingest must be counted, not hidden)."""
    client = TimedClient(subject.port)
    results = {kind: Latencies() for kind in requests}
    # The cyclic collector stays out of the timed loop (as timeit keeps it out): a collection in this
    # client lands on whichever request it interrupts, of either service (seen: 10-35 ms pauses with
    # the feed's objects in the heap).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        asked = 0
        for _ in range(max_rounds):
            for index, query in enumerate(feed.queries):
                for kind, kind_requests in requests.items():
                    elapsed, response = _timed_post(client, *kind_requests[index])
                    results[kind].samples_s.append(elapsed)
                    results[kind].checked += 1
                    results[kind].correct += subject.blocks_per_engine(response) == query.expected_blocks
                asked += 1
                if asked % 10 == 0 and not keep_going():
                    return results
            if not keep_going():
                break
    finally:
        client.close()
        if gc_was_enabled:
            gc.enable()
    return results


def ingest_first_round(
    subject: Subject, publishers: Publishers, result: SubjectResult, ingest_timeout_s: float
) -> None:
    """Attach, ingest round 0 (timed), and the RSS before and after it."""
    publishers.await_subscribers()
    result.rss_before = subject.rss_bytes()
    publishers.start_round(0)
    await_ingest(subject, 0, ingest_timeout_s)
    done = time.monotonic()
    first, last = publishers.finish_round()
    result.ingest_s, result.publish_s = done - first, last - first
    # Steady state, for both subjects alike: give each a moment to settle after the burst (kvindex
    # hands freed payload pages back to the OS once ingest is idle).
    time.sleep(0.5)  # ok: a fixed settling time, not a wait for a condition
    result.rss_after = subject.rss_bytes()


def _time_during_ingest(
    subject: Subject,
    publishers: Publishers,
    feed: Feed,
    requests: dict[str, list[tuple[str, bytes]]],
    result: SubjectResult,
    ingest_timeout_s: float,
) -> None:
    """Rounds 1, 2, ... published while queries run (all but the full-answer row), each until it is
    ingested, until every kind has DURING_MIN_SAMPLES requests timed under ingest (at most
    DURING_MAX_ROUNDS rounds): a service that stalls behind a round answers few requests during it (Dynamo
    ~13 a round here), and a p99 of a few dozen samples is its maximum, whose interval says nothing."""
    during_requests = {kind: made for kind, made in requests.items() if kind != "tokens_full"}
    result.during = {kind: Latencies() for kind in during_requests}
    for round_index in range(1, DURING_MAX_ROUNDS + 1):
        publishers.start_round(round_index)
        timed = time_queries_during(
            subject,
            feed,
            during_requests,
            keep_going=lambda round_index=round_index: not subject.caught_up(round_index),
            max_rounds=20,
        )
        await_ingest(subject, round_index, ingest_timeout_s)
        done = time.monotonic()  # to within the 10 queries between checks
        first, _ = publishers.finish_round()
        if result.during_ingest_s is None:
            result.during_ingest_s = done - first  # the first round's: the ingest row compares one round
        for kind, latencies in timed.items():
            result.during[kind].add(latencies)
        if min(len(latencies.samples_s) for latencies in result.during.values()) >= DURING_MIN_SAMPLES:
            break


def run_subject(
    kind: str,
    feed: Feed,
    *,
    measure_during: bool,
    query_kinds: Sequence[str],
    ingest_timeout_s: float,
    serve_args: Sequence[str] = (),
) -> SubjectResult:
    """One service on its own: start, attach, ingest round 0 (timed), RSS, idle queries, rounds 1, ... under
    queries."""
    result = SubjectResult(kind, feed.num_blocks)
    with (
        Publishers(feed.payloads) as publishers,
        start_subject(kind, publishers, feed, serve_args) as subject,
    ):
        ingest_first_round(subject, publishers, result, ingest_timeout_s)
        requests = _requests(subject, feed, query_kinds)
        (result.idle,) = time_queries_paired([subject], feed, [requests])
        if measure_during:
            _time_during_ingest(subject, publishers, feed, requests, result, ingest_timeout_s)
    return result


def time_queries_paired(
    subjects: Sequence[Subject],
    feed: Feed,
    requests: Sequence[dict[str, list[tuple[str, bytes]]]],
    floor_ports: Sequence[int] = (),
    observe: Callable[[int, str, float], None] | None = None,
) -> list[dict[str, Latencies]]:
    """Idle latency of several services, request by request in turn (the first to ask swaps every
    query), each answer checked: a stall of this shared box lands on whichever request it meets, so
    over a phase it meets both services alike instead of the one that happened to run then.

    `floor_ports`: floor servers (benchmarks/floor.py) taken in turn too, each sent the first service's
    requests, their answers not checked; their latencies come last, in this order. `observe(at, kind,
    seconds)` is called after each timed request, outside its window (`at`: the service's place in
    `subjects`, then the floors')."""
    if not subjects:  # every service failed before its queries
        return []
    clients = [TimedClient(subject.port) for subject in subjects]
    clients.extend(TimedClient(port) for port in floor_ports)
    requests = [*requests, *[requests[0]] * len(floor_ports)]
    results = [{kind: Latencies() for kind in made} for made in requests]
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as in time_queries_during
    try:
        for client, made in zip(clients, requests, strict=True):
            for path, body in next(iter(made.values()))[:3]:  # untimed warm-up
                client.post(path, body)
        order = list(range(len(clients)))
        for index, query in enumerate(feed.queries):
            for kind in requests[0]:
                for at in order if index % 2 == 0 else reversed(order):
                    elapsed, response = _timed_post(clients[at], *requests[at][kind][index])
                    if observe is not None:
                        observe(at, kind, elapsed)
                    latencies = results[at][kind]
                    latencies.samples_s.append(elapsed)
                    if at < len(subjects):
                        latencies.checked += 1
                        latencies.correct += subjects[at].blocks_per_engine(response) == query.expected_blocks
    finally:
        for client in clients:
            client.close()
        if gc_was_enabled:
            gc.enable()
    return results


def run_round(
    kinds: Sequence[str],
    feed: Feed,
    *,
    measure_during: bool,
    query_kinds: Sequence[str],
    ingest_timeout_s: float,
    log: Callable[[str], None],
) -> dict[str, SubjectResult]:
    """One round of every service on identical payload bytes: each ingests round 0 alone (in `kinds`'
    order, the others idle), then their idle queries are timed in turn (time_queries_paired), then each
    ingests rounds 1, ... alone under queries (_time_during_ingest)."""
    results = {kind: SubjectResult(kind, feed.num_blocks) for kind in kinds}
    alive: dict[str, tuple[Subject, Publishers]] = {}
    with ExitStack() as stack:
        for kind in kinds:
            try:
                publishers = stack.enter_context(Publishers(feed.payloads))
                subject = stack.enter_context(start_subject(kind, publishers, feed))
                ingest_first_round(subject, publishers, results[kind], ingest_timeout_s)
                alive[kind] = subject, publishers
            except (TimeoutError, RuntimeError, OSError) as exc:
                _failed(results[kind], exc, log)
        requests = {kind: _requests(subject, feed, query_kinds) for kind, (subject, _) in alive.items()}
        subjects = [subject for subject, _ in alive.values()]
        floor = _start_floor(stack, subjects, list(requests.values()), log)
        paired = time_queries_paired(
            subjects, feed, list(requests.values()), () if floor is None else (floor.port,)
        )
        if floor is not None:
            results[FLOOR] = SubjectResult(FLOOR, feed.num_blocks, idle=paired.pop())
        for kind, idle in zip(alive, paired, strict=True):
            results[kind].idle = idle
        for kind, (subject, publishers) in alive.items() if measure_during else ():
            try:
                _time_during_ingest(
                    subject, publishers, feed, requests[kind], results[kind], ingest_timeout_s
                )
            except (TimeoutError, RuntimeError, OSError) as exc:
                _failed(results[kind], exc, log)
    return results


def _start_floor(
    stack: ExitStack,
    subjects: Sequence[Subject],
    requests: Sequence[dict[str, list[tuple[str, bytes]]]],
    log: Callable[[str], None],
) -> FloorServer | None:
    """A FloorServer answering the first service's answer to its first request (None without a service or
    a query, or if it cannot start: the floor is a reference, never a reason to lose a round)."""
    first_kind = next(iter(requests[0].values()), []) if subjects else []
    if not first_kind:
        return None
    path, body = first_kind[0]
    client = JsonClient(subjects[0].port)
    try:
        answer = json.dumps(client.request("POST", path, body), separators=(",", ":")).encode()
        return stack.enter_context(FloorServer(answer))
    except (TimeoutError, RuntimeError, OSError) as exc:
        log(f"  the floor server did not start: {type(exc).__name__}: {exc}"[:300])
        return None
    finally:
        client.close()


def _failed(result: SubjectResult, exc: BaseException, log: Callable[[str], None]) -> None:
    result.error = f"{type(exc).__name__}: {exc}"[:300]
    log(f"  {result.name} failed: {result.error}")


def run_pair(
    feed: Feed,
    *,
    dynamo_ok: bool,
    measure_during: bool,
    query_kinds: Sequence[str],
    ingest_timeout_s: float,
    log: Callable[[str], None],
    rounds: int = 1,
) -> dict[str, SubjectResult]:
    """kvindex and Dynamo (if available) on identical payload bytes, `rounds` times (run_round; the
    subjects swap places each round, so neither always ingests first) and merged (see merge_rounds)."""
    kinds = ("kvindex", "Dynamo") if dynamo_ok else ("kvindex",)
    runs: dict[str, list[SubjectResult]] = {kind: [] for kind in kinds}  # and FLOOR once it answered
    for round_no in range(rounds):
        order = kinds if round_no % 2 == 0 else tuple(reversed(kinds))
        suffix = f" (round {round_no + 1} of {rounds})" if rounds > 1 else ""
        log(
            f"  {' + '.join(order)}: {feed.spec.num_engines} engines x {feed.spec.blocks_per_engine} blocks{suffix} ..."
        )
        for kind, result in run_round(
            order,
            feed,
            measure_during=measure_during,
            query_kinds=query_kinds,
            ingest_timeout_s=ingest_timeout_s,
            log=log,
        ).items():
            runs.setdefault(kind, []).append(result)
    return {kind: merge_rounds(kind_runs) for kind, kind_runs in runs.items()}


def merge_rounds(runs: Sequence[SubjectResult]) -> SubjectResult:
    """One subject's rounds as one result: the round of median ingest time gives the ingest, publish and
    memory figures, and the latency samples of every round are pooled (so a p99 rests on all of them). A
    failed round is left out; if every round failed, the last failure is the result."""
    ok = [run for run in runs if run.error is None and (run.ingest_s is not None or run.name == FLOOR)]
    if not ok:
        return runs[-1]
    median = sorted(ok, key=lambda run: run.ingest_s or 0.0)[(len(ok) - 1) // 2]
    merged = replace(median, idle={}, during={})
    for run in ok:
        for phase in ("idle", "during"):
            pooled: dict[str, Latencies] = getattr(merged, phase)
            for kind, latencies in getattr(run, phase).items():
                pooled.setdefault(kind, Latencies()).add(latencies)
    during = sorted(run.during_ingest_s for run in ok if run.during_ingest_s is not None)
    merged.during_ingest_s = during[(len(during) - 1) // 2] if during else None
    return merged


def build(spec: WorkloadSpec, log: Callable[[str], None], *, lean: bool = False) -> Feed:
    """The feed for `spec`; `lean` keeps only the payload bytes (no queries), for very large runs."""
    began = time.perf_counter()
    if lean:
        payloads, num_events, num_blocks = build_payloads(spec)
        feed = Feed(spec, payloads, num_events, num_blocks, [])
    else:
        workload = build_workload(spec)
        payloads = [encode_engine(engine) for engine in workload.engines]
        feed = Feed(spec, payloads, workload.num_events, workload.num_blocks, workload.queries)
    gc.freeze()  # the feed lives as long as the run: no collection need walk it again
    log(
        f"  built {spec.num_engines} engines x {spec.blocks_per_engine} blocks "
        f"({feed.num_events} BlockStored) in {time.perf_counter() - began:.1f}s"
    )
    return feed
