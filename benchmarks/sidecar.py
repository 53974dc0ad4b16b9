"""What the sidecar hop costs (not a timed test): `python -m benchmarks.sidecar [--quick]`.

An engine (the project's vLLM-identical EventPublisher, in this process) publishes real BlockStored batches
(sha256 hashes of their token ids, so the sidecar's full-rate hash check runs on every one). `kvindex
sidecar` runs as its own process and dials the engine; a central kvindex (IngestService, in this process)
takes the sidecar's stream in bind mode (the sidecar dials its --listen; everything on 127.0.0.1). Measured:

- latency engine publish -> central apply (the central's applied seq reaches the batch), one batch at a
  time, p50/p99, with the central dialling the engine directly (baseline, same run) and through the sidecar;
- the sidecar process's CPU seconds (utime + stime, /proc) per 1,000 blocks relayed and hash-checked;
- for a block set of --blocks (default 100,000): the snapshot's size (msgpack and JSON), the time to fetch
  and decode it, and a fresh central's join through it (start -> pod live with every block);
- the sidecar's RSS growth per block held.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvindex.hashing import BlockHasher
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.ingest.snapshot_fetcher import fetch_snapshot
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import BlockStored

from benchmarks._process import await_condition, process_rss_bytes, run_main
from benchmarks._table import format_table

MODEL = ModelConfig(name="m", block_size=16)
POD = "pod-a"
REF = PodRef(POD, 0)
BLOCKS_PER_BATCH = 64
CENTRAL = IngestSettings(quiet_probe_after_s=1.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """A publisher and a counter of prompts: each batch stores a fresh prompt's blocks from block 0."""

    def __init__(self) -> None:
        self.publisher = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
        self.hasher = BlockHasher(algo="sha256", block_size=MODEL.block_size, seed=None, memo_size=0)
        self.prompt = 0
        self.blocks = 0

    def store(self, num_blocks: int) -> None:
        self.prompt += 1
        tokens = [self.prompt * 100_000 + i for i in range(num_blocks * MODEL.block_size)]
        keys = self.hasher.event_hashes(tokens)
        event = BlockStored(keys, None, tokens, MODEL.block_size, None, "GPU", None, [None] * num_blocks)
        assert self.publisher.publish([event])
        self.blocks += num_blocks

    def close(self) -> None:
        self.publisher.close()


class SidecarProcess:
    """`kvindex sidecar` dialling the engine and a central's --listen; its ports are fixed up front."""

    def __init__(self, engine: Engine) -> None:
        self.listen, self.replay, self.http = free_port(), free_port(), free_port()
        argv = [
            sys.executable, "-m", "kvindex", "sidecar", "--pod", POD, "--model", MODEL.name,
            "--engine", engine.publisher.endpoint, "--engine-replay", engine.publisher.replay_endpoint or "",
            "--publish", f"tcp://127.0.0.1:{self.listen}", "--replay", f"tcp://127.0.0.1:{self.replay}",
            "--http", f"127.0.0.1:{self.http}", "--log-level", "warning",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # the engine hashes unset
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            self._log.seek(0)
            raise RuntimeError(f"kvindex sidecar did not start: {line!r} {self._log.read()[-2000:]!r}")
        self.url = f"http://127.0.0.1:{self.http}"

    def central_settings(self) -> IngestSettings:
        return IngestSettings(
            quiet_probe_after_s=1.0,
            listen_replay_template=f"tcp://127.0.0.1:{self.replay}",
            listen_snapshot_template=f"{self.url}/v1/snapshot",
        )

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self) -> int:
        return process_rss_bytes(self.proc.pid)

    def downstream_seq(self) -> int | None:
        import json

        with urllib.request.urlopen(self.url + "/v1/status", timeout=10) as response:
            seq = json.loads(response.read())["ranks"][0]["downstream_seq"]
        return None if seq is None else int(seq)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._log.close()


@contextmanager
def central(pods: list[PodConfig], listen: str | None, settings: IngestSettings) -> Iterator[IngestService]:
    service = IngestService([MODEL], pods, listen=listen, settings=settings)
    service.start()
    try:
        yield service
    finally:
        service.stop()


def applied(service: IngestService) -> int | None:
    return service.applied_seqs().get(REF)


def latencies(engine: Engine, service: IngestService, n: int, offset: int) -> list[float]:
    """Publish one 1-block batch at a time; the time until the central applied it (its seq is the
    engine's seq + `offset`: the downstream seq when a sidecar is between them)."""
    out = []
    for _ in range(n):
        seq = (engine.publisher.last_seq if engine.publisher.last_seq is not None else -1) + 1 + offset
        started = time.perf_counter()
        engine.store(1)
        deadline = started + 10
        while (applied(service) or -1) < seq:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"seq {seq} not applied within 10 s")
            time.sleep(0.0001)  # ok: the poll bounds the measurement's resolution (0.1 ms)
        out.append(time.perf_counter() - started)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sidecar", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--blocks", type=int, default=100_000, help="block set for the snapshot figures")
    parser.add_argument("--samples", type=int, default=300, help="latency samples per path")
    args = parser.parse_args()
    blocks, samples = (5_000, 40) if args.quick else (args.blocks, args.samples)
    rows: list[list[object]] = []

    # Baseline: the central dials the engine directly.
    engine = Engine()
    try:
        pod = PodConfig(POD, engine.publisher.endpoint, MODEL.name, engine.publisher.replay_endpoint)
        with central([pod], None, CENTRAL) as service:
            await_condition(service.ready, 15, "the central's join")
            engine.store(1)
            await_condition(lambda: applied(service) == 0, 15, "the first batch")
            direct = latencies(engine, service, samples, 0)
    finally:
        engine.close()

    engine = Engine()
    sidecar = SidecarProcess(engine)
    try:
        settings = sidecar.central_settings()
        with central([], f"tcp://127.0.0.1:{sidecar.listen}", settings) as service:
            engine.store(1)  # bind mode: the central knows the pod from its first batch

            def first_applied() -> bool:
                if applied(service) is None:
                    engine.store(1)  # until the sidecar's PUB has our subscription
                    return False
                return True

            await_condition(first_applied, 30, "the sidecar's first batch at the central", poll_s=0.05)
            await_condition(lambda: applied(service) == sidecar.downstream_seq(), 15, "the central caught up")
            offset = (applied(service) or 0) - (engine.publisher.last_seq or 0)
            via = latencies(engine, service, samples, offset)
        for name, values in (("direct (engine -> kvindex)", direct), ("through the sidecar", via)):
            rows.append(
                [
                    f"publish -> apply, {name}",
                    f"p50 {statistics.median(values) * 1e3:.2f} ms, p99 {percentile(values, 0.99) * 1e3:.2f} ms",
                ]
            )
        added = statistics.median(via) - statistics.median(direct)
        rows.append(["added by the sidecar hop (p50)", f"{added * 1e3:.2f} ms"])

        # CPU and RSS while the block set grows to `blocks`.
        rss_before, cpu_before = sidecar.rss(), sidecar.cpu_s()
        start_blocks = engine.blocks
        while engine.blocks - start_blocks < blocks:
            engine.store(BLOCKS_PER_BATCH)
            if engine.prompt % 200 == 0:
                engine.publisher.flush(30)
        engine.publisher.flush(60)
        last = engine.publisher.last_seq
        await_condition(
            lambda: sidecar.downstream_seq() == (last or 0) + offset,
            120,
            "the sidecar to relay all",
            poll_s=0.1,
        )
        relayed = engine.blocks - start_blocks
        cpu = sidecar.cpu_s() - cpu_before
        rss_growth = sidecar.rss() - rss_before
        rows.append(
            ["sidecar CPU per 1,000 blocks (relay + hash check)", f"{cpu / relayed * 1e3 * 1e3:.1f} ms"]
        )
        rows.append([f"sidecar RSS growth per block ({relayed:,} blocks)", f"{rss_growth / relayed:.0f} B"])

        held = engine.blocks
        url = f"{sidecar.url}/v1/snapshot"
        started = time.perf_counter()
        result = fetch_snapshot(url, timeout_s=30, max_bytes=1 << 30)
        fetched = time.perf_counter() - started
        assert result.snapshot is not None, result.error
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            json_bytes = len(response.read())
        rows.append(
            [
                f"snapshot of {held:,} blocks",
                f"{result.num_bytes / 1e6:.2f} MB msgpack, {json_bytes / 1e6:.2f} MB JSON",
            ]
        )
        rows.append(["snapshot fetch + decode", f"{fetched * 1e3:.0f} ms"])
        started = time.perf_counter()
        with central([], f"tcp://127.0.0.1:{sidecar.listen}", settings) as fresh:

            def joined() -> bool:
                statuses = fresh.pod_statuses()
                if not statuses:
                    engine.store(1)  # bind mode: a batch makes the pod known
                    return False
                return statuses[0].blocks >= held and statuses[0].state == "live"

            await_condition(joined, 60, "a fresh central's join through the snapshot", poll_s=0.01)
            join_s = time.perf_counter() - started
            assert fresh.counters().snapshots.get("ok", 0) >= 1
        rows.append([f"fresh central join via snapshot ({held:,} blocks)", f"{join_s * 1e3:.0f} ms"])
    finally:
        sidecar.close()
        engine.close()
    print(format_table(["measure", "value"], rows))
    return 0


if __name__ == "__main__":
    run_main(main, "the sidecar and the engine were stopped")
