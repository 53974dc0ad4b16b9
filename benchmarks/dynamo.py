"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime) as a benchmark peer.

Runs it as a subprocess from a separate venv (never a kvindex dependency), points its ZMQ SUB sockets at
our bound PUB sockets, and drives its HTTP API: /query (token ids), /query_by_hash (Dynamo's own
per-block XXH3 hashes, not vLLM's event hashes), /metrics (events applied, to know ingest is done).
`python -m benchmarks.dynamo --quick` is a standalone check; without --quick it measures ingest and query.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import xxhash

from benchmarks._process import ManagedProcess, await_condition

DEFAULT_PYTHON = "/work/dynvenv/bin/python"
PYTHON_ENV_VAR = "KVINDEX_DYNAMO_PYTHON"
# Dynamo's LocalBlockHash: XXH3-64 of the block's token ids as u32 little-endian, seed 1337, one block at
# a time (not chained; position comes from the radix tree). lib/kv-router protocols.rs XXH3_SEED.
DYNAMO_XXH3_SEED = 1337
_EVENTS_APPLIED = re.compile(r'^dynamo_kvrouter_kv_cache_events_applied\{event_type="(\w+)",[^}]*\}\s+(\S+)$')


class DynamoUnavailable(RuntimeError):
    """Dynamo's indexer cannot be run here; the message says why."""


def dynamo_python() -> str:
    """The interpreter that has ai-dynamo-runtime: $KVINDEX_DYNAMO_PYTHON, else /work/dynvenv/bin/python."""
    return os.environ.get(PYTHON_ENV_VAR) or DEFAULT_PYTHON


def available(python: str | None = None) -> tuple[bool, str]:
    """(True, version) when `python -m dynamo.indexer` can run, else (False, the reason)."""
    interpreter = python or dynamo_python()
    if not Path(interpreter).exists():
        return False, f"no Dynamo interpreter at {interpreter} (set {PYTHON_ENV_VAR})"
    probe = "import dynamo.indexer, importlib.metadata as m; print(m.version('ai-dynamo-runtime'))"
    try:
        result = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{interpreter} could not import dynamo.indexer: {exc}"
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        return False, f"{interpreter} could not import dynamo.indexer: {last_line}"
    return True, f"ai-dynamo-runtime {result.stdout.strip()}"


def dynamo_local_hashes(token_ids: Sequence[int], block_size: int = 16) -> list[int]:
    """The hashes /query_by_hash expects for a prompt (full blocks only), as signed i64 (its JSON type)."""
    hashes: list[int] = []
    block_format = f"<{block_size}I"
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = xxhash.xxh3_64_intdigest(
            struct.pack(block_format, *token_ids[start : start + block_size]), seed=DYNAMO_XXH3_SEED
        )
        hashes.append(digest - (1 << 64) if digest >= 1 << 63 else digest)
    return hashes


def _free_port() -> int:
    # NOTE: Dynamo takes a fixed --port only, so there is a small window in which another process could
    # take this port; start() then fails with the log tail and the caller can retry.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class DynamoIndexer(ManagedProcess):
    """One `python -m dynamo.indexer` process; a context manager that starts it and always stops it.

    `workers` maps Dynamo worker ids to ZMQ endpoints. Dynamo *connects* a SUB (subscribed to every
    topic) to each endpoint, so publishers must bind them. Scores come back per worker id as matched
    blocks (Dynamo reports tokens; we divide by the block size).
    """

    def __init__(
        self,
        workers: Mapping[int, str],
        *,
        block_size: int = 16,
        threads: int = 2,
        model_name: str = "default",
        python: str | None = None,
        startup_timeout_s: float = 60.0,
        request_timeout_s: float = 10.0,
    ) -> None:
        if not workers:
            raise ValueError("Dynamo needs at least one worker endpoint")
        self.workers = dict(workers)
        self.block_size = block_size
        self.threads = threads
        self.model_name = model_name
        self.python = python or dynamo_python()
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._connection: http.client.HTTPConnection | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def command(self) -> list[str]:
        worker_list = ",".join(f"{worker_id}={endpoint}" for worker_id, endpoint in self.workers.items())
        return [
            self.python, "-m", "dynamo.indexer",
            "--block-size", str(self.block_size),
            "--port", str(self.port),
            "--threads", str(self.threads),
            "--model-name", self.model_name,
            "--workers", worker_list,
        ]  # fmt: skip

    def start(self) -> None:
        """Start the process; return once its HTTP answers and every worker's listener is active."""
        ok, reason = available(self.python)
        if not ok:
            raise DynamoUnavailable(reason)
        self.port = _free_port()
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, RUST_LOG=os.environ.get("DYN_LOG", "warn"))
        self._process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            await_condition(
                self._listeners_active, self.startup_timeout_s, "Dynamo's HTTP server and listeners"
            )
        except BaseException:
            self.stop()
            raise

    def _listeners_active(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise DynamoUnavailable(
                f"dynamo.indexer exited with {self._process.returncode}: {self.log_tail()}"
            )
        try:
            listed = self._request("GET", "/workers")
        except (OSError, http.client.HTTPException):
            return False
        active = {
            int(worker["instance_id"])
            for worker in listed
            if all(listener.get("status") == "active" for listener in worker.get("listeners", {}).values())
        }
        return active >= set(self.workers)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (SIGTERM), wait, then kill if it lingers. Idempotent."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        super().stop(timeout_s)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One request on a persistent connection (reconnects once if the server closed it)."""
        payload = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"content-type": "application/json"}
        for attempt in (0, 1):
            if self._connection is None:
                self._connection = http.client.HTTPConnection(
                    "127.0.0.1", self.port, timeout=self.request_timeout_s
                )
            try:
                self._connection.request(method, path, body=payload, headers=headers)
                response = self._connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                self._connection.close()
                self._connection = None
                if attempt:
                    raise
                continue
            if response.status >= 400:
                raise RuntimeError(f"{method} {path} -> {response.status}: {data[:300]!r}")
            return json.loads(data) if path != "/metrics" else data.decode()
        raise AssertionError("unreachable")

    def _blocks_per_worker(self, response: Mapping[str, Any]) -> dict[int, int]:
        # {"scores": {"<worker_id>": {"<dp_rank>": matched_tokens}}}; we keep the best dp rank.
        return {
            int(worker_id): max(by_rank.values()) // self.block_size
            for worker_id, by_rank in response.get("scores", {}).items()
            if by_rank and max(by_rank.values()) > 0
        }

    def query(self, token_ids: Sequence[int]) -> dict[int, int]:
        """POST /query: worker id -> leading blocks held (Dynamo hashes the tokens itself)."""
        response = self._request(
            "POST", "/query", {"token_ids": list(token_ids), "model_name": self.model_name}
        )
        return self._blocks_per_worker(response)

    def query_by_hash(self, local_hashes: Sequence[int]) -> dict[int, int]:
        """POST /query_by_hash with Dynamo LocalBlockHashes (see dynamo_local_hashes), not vLLM's."""
        body = {"block_hashes": list(local_hashes), "model_name": self.model_name}
        return self._blocks_per_worker(self._request("POST", "/query_by_hash", body))

    def events_applied(self) -> dict[str, int]:
        """Events the index has processed so far, by type (stored/removed/cleared), any outcome."""
        counts: dict[str, int] = {}
        for line in self._request("GET", "/metrics").splitlines():
            match = _EVENTS_APPLIED.match(line)
            if match:
                counts[match[1]] = counts.get(match[1], 0) + int(float(match[2]))
        return counts

    def wait_for_events(self, num_events: int, timeout_s: float = 120.0) -> None:
        """Block until `num_events` KV events (all types) have been applied."""
        await_condition(
            lambda: sum(self.events_applied().values()) >= num_events, timeout_s, f"{num_events} events"
        )


# --- standalone check and measurement ----------------------------------------------------------


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run(num_engines: int, blocks_per_engine: int, num_queries: int, threads: int) -> int:
    """Publish the issue-6 workload to Dynamo over real ZMQ, check its answers, print figures."""
    import zmq

    from benchmarks.workload import WorkloadSpec, build_workload, encode_engine

    ok, reason = available()
    if not ok:
        print(f"Dynamo not available: {reason}")
        return 1
    spec = WorkloadSpec(num_engines=num_engines, blocks_per_engine=blocks_per_engine, num_queries=num_queries)
    workload = build_workload(spec)
    payloads = [encode_engine(engine) for engine in workload.engines]
    ctx = zmq.Context()
    # XPUB behaves as PUB on the wire and also tells us when Dynamo's SUB has subscribed.
    sockets = [ctx.socket(zmq.XPUB) for _ in workload.engines]
    try:
        for sock in sockets:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVTIMEO, 30_000)
            sock.bind("tcp://127.0.0.1:0")
        endpoints = {i + 1: sock.getsockopt_string(zmq.LAST_ENDPOINT) for i, sock in enumerate(sockets)}
        print(f"{reason}; {num_engines} engines x {blocks_per_engine} blocks, threads={threads}")
        with DynamoIndexer(endpoints, block_size=spec.block_size, threads=threads) as dynamo:
            for sock in sockets:
                sock.recv()  # the subscription message: Dynamo's SUB is attached
            rss_before = dynamo.rss_bytes()
            started = time.perf_counter()
            for seq in range(max(len(p) for p in payloads)):
                for sock, engine_payloads in zip(sockets, payloads, strict=True):
                    if seq < len(engine_payloads):
                        sock.send_multipart([b"", seq.to_bytes(8, "big"), engine_payloads[seq]])
            sent = time.perf_counter() - started
            dynamo.wait_for_events(workload.num_events)
            elapsed = time.perf_counter() - started
            print(
                f"ingest: {workload.num_events} events, {workload.num_blocks} blocks in {elapsed:.3f}s "
                f"= {workload.num_blocks / elapsed:,.0f} blocks/s (our publishing took {sent:.3f}s of it)"
            )
            print(
                f"rss: {rss_before / 2**20:.1f} MiB before, {dynamo.rss_bytes() / 2**20:.1f} MiB after ingest"
            )
            failures = 0
            # Dynamo's own hashes are computed before timing, as a router would hold them already.
            local_hashes = [
                dynamo_local_hashes(query.token_ids, spec.block_size) for query in workload.queries
            ]
            asks: list[tuple[str, Callable[[int], dict[int, int]]]] = [
                ("/query", lambda i: dynamo.query(workload.queries[i].token_ids)),
                ("/query_by_hash", lambda i: dynamo.query_by_hash(local_hashes[i])),
            ]
            for label, ask in asks:
                latencies = []
                for index, query in enumerate(workload.queries):
                    t0 = time.perf_counter()
                    got = ask(index)
                    latencies.append(time.perf_counter() - t0)
                    expected = {engine_index + 1: n for engine_index, n in query.expected_blocks.items()}
                    if got != expected:
                        failures += 1
                        if failures <= 3:
                            print(f"  MISMATCH {label}: got {got} expected {expected}")
                print(
                    f"{label}: {len(latencies)} queries of {spec.query_blocks} blocks, "
                    f"p50 {_percentile(latencies, 0.5) * 1e3:.2f} ms, p99 {_percentile(latencies, 0.99) * 1e3:.2f} ms"
                )
            if workload.queries:
                print(
                    f"example: query 0 -> {dynamo.query(workload.queries[0].token_ids)} (worker id -> blocks)"
                )
            print("answers: all as expected" if failures == 0 else f"answers: {failures} mismatches")
            return 0 if failures == 0 else 1
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynamo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 engines x 300 blocks, 5 queries")
    parser.add_argument("--engines", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks per engine")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2, help="Dynamo --threads")
    args = parser.parse_args(argv)
    if args.quick:
        return run(2, 300, 5, args.threads)
    return run(args.engines, args.blocks, args.queries, args.threads)


if __name__ == "__main__":
    sys.exit(main())
