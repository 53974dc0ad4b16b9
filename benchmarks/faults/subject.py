"""Fault harness, the kvindex side: the indexer under test, in this process (IngestService, its index
read directly) or as a `kvindex serve` subprocess (read over HTTP: /v1/pods and /v1/score with
block_hashes), each able to start, stall, die and come back, and to show what it claims per pod.

Stalling: the subprocess gets SIGSTOP/SIGCONT. In process, the harness holds every shard lock of the
index, so the worker waits inside its next `apply`; with small queues the poller then waits for room,
stops reading its SUB sockets, and the engines' PUB high-water marks drop what follows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Protocol

import msgspec
import zmq
from kvindex.indexer.events import TIER_GPU
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig

from benchmarks.faults.engines import BLOCK_SIZE, HASH_SEED
from benchmarks.service import JsonClient, KvindexService

MODEL = "m"
_REBIND_TIMEOUT_S = 10.0

PodKey = tuple[str, int]  # (pod id, dp rank) as kvindex names a stream


class PodView(msgspec.Struct, frozen=True):
    """What kvindex says about one stream: its /v1/pods row and the GPU blocks it claims."""

    state: str
    partial_view: bool
    last_seq: int | None
    claims: frozenset[int]
    detail: str = ""  # the rest of the row, for a failure's report


def status_detail(row: dict[str, object]) -> str:
    """The /v1/pods fields that tell a failure's story, on one line."""
    age = row.get("last_event_age_s")
    heard = f"last events {age:.1f}s ago" if isinstance(age, int | float) else "no events yet"
    return (
        f"last_seq {row.get('last_seq')}, events {row.get('events_total')}, gaps {row.get('gaps_total')}, "
        f"replays {row.get('replays_total')}, restarts {row.get('restarts_total')}, {heard}"
    )


class Subject(Protocol):
    """The kvindex under test."""

    def start(self) -> None: ...

    def stall(self) -> bool:
        """Stop ingesting (until `resume`); False if the stall could not be brought about."""
        ...

    def resume(self) -> None: ...

    def crash(self) -> None:
        """Die without a goodbye (kill -9, or abandoned); `start` brings up a fresh one."""
        ...

    def view(self, universe: Collection[int]) -> dict[PodKey, PodView]:
        """Every stream kvindex lists, with its claims among `universe` (every hash ever stored)."""
        ...

    @property
    def reconnect_cap_s(self) -> float:
        """The longest kvindex's SUB waits between redials of an engine that was gone."""
        ...

    def diagnostics(self) -> list[str]:
        """Process-wide counters worth a failure's report."""
        ...

    def close(self) -> None: ...


class HarnessKnobs(msgspec.Struct, frozen=True):
    """kvindex's settings in the harness: small, so faults show within a second."""

    quiet_probe_after_s: float = 0.3
    replay_timeout_s: float = 2.0
    hash_check_every: int = 8
    # In process only: the stall needs one worker and small queues (see the module docstring).
    queue_size: int = 32
    queue_full_wait_s: float = 5.0
    rcvhwm: int = 32
    reconnect_ivl_max_ms: int = 500


def model_config() -> ModelConfig:
    return ModelConfig(name=MODEL, block_size=BLOCK_SIZE, hash_algo="sha256", hash_seed=HASH_SEED)


def ingest_settings(knobs: HarnessKnobs, *, listen_replay: str | None) -> IngestSettings:
    return IngestSettings(
        num_workers=1,
        queue_size=knobs.queue_size,
        queue_full_wait_s=knobs.queue_full_wait_s,
        quiet_probe_after_s=knobs.quiet_probe_after_s,
        replay_timeout_s=knobs.replay_timeout_s,
        hash_check_every=knobs.hash_check_every,
        rcvhwm=knobs.rcvhwm,
        reconnect_ivl_max_ms=knobs.reconnect_ivl_max_ms,
        listen_replay_template=listen_replay,
    )


# --- in process -----------------------------------------------------------------------------------


class InprocSubject:
    """kvindex as an IngestService in this process; `crash` stops it and `start` builds a new one."""

    def __init__(self, pods: Sequence[PodConfig], listen: Sequence[str], settings: IngestSettings) -> None:
        self._pods = list(pods)
        self._listen = list(listen)
        self._settings = settings
        self.service: IngestService | None = None
        self._held: list[threading.Lock] = []
        self.reconnect_cap_s = settings.reconnect_ivl_max_ms / 1000

    def start(self) -> None:
        deadline = time.monotonic() + _REBIND_TIMEOUT_S
        while True:
            service = IngestService(
                [model_config()],
                self._pods,
                listen=self._listen or None,
                settings=self._settings,
            )
            try:
                service.start()
            except zmq.ZMQError as exc:
                service.stop()
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # ok: the previous service's listen port is still being released
                continue
            self.service = service
            return

    def stall(self) -> bool:
        if self.service is None or self._held:
            return False
        runtime = self.service.model(MODEL)
        assert runtime is not None
        # NOTE: the index's own locks (private): a worker that reaches `apply` waits there, as a stalled
        # indexer would; readers (the harness's view) wait too, so views are taken only after `resume`.
        self._held = list(runtime.index._locks)
        for lock in self._held:
            lock.acquire()
        return True

    def resume(self) -> None:
        for lock in reversed(self._held):
            lock.release()
        self._held = []

    def crash(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    def view(self, universe: Collection[int]) -> dict[PodKey, PodView]:
        service = self.service
        if service is None:
            return {}
        runtime = service.model(MODEL)
        assert runtime is not None
        claims: dict[PodKey, set[int]] = {}
        for key, entries in runtime.index.snapshot().items():
            for pod, tier in entries:
                if tier == TIER_GPU:
                    claims.setdefault((pod.pod_id, pod.dp_rank), set()).add(key)
        return {
            (status.pod, status.dp_rank): PodView(
                state=status.state,
                partial_view=status.partial_view,
                last_seq=status.last_seq,
                claims=frozenset(claims.get((status.pod, status.dp_rank), ())),
                detail=status_detail(msgspec.structs.asdict(status)),
            )
            for status in service.pod_statuses()
        }

    def diagnostics(self) -> list[str]:
        if self.service is None:
            return ["kvindex is not running"]
        counters = self.service.counters()
        return [
            f"kvindex counters: replays {counters.replays}, dropped {counters.dropped}, gaps {counters.gaps}, "
            f"history_lost {counters.history_lost}, restarts {counters.restarts}"
        ]

    def close(self) -> None:
        self.resume()
        self.crash()


# --- a `kvindex serve` subprocess -------------------------------------------------------------------


def serve_config(
    pods: Sequence[PodConfig], listen: Sequence[str], listen_replay: str | None, knobs: HarnessKnobs
) -> str:
    """The TOML a `kvindex serve` under test reads (what the in-process settings say, where the file
    has a key for it)."""
    lines = []
    if listen:
        lines.append(f"listen = {json.dumps(list(listen))}")
    if listen_replay is not None:
        lines.append(f"listen_replay = {json.dumps(listen_replay)}")
    lines += [
        "",
        "[[models]]",
        f'name = "{MODEL}"',
        f"block_size = {BLOCK_SIZE}",
        'hash_algo = "sha256"',
        f'hash_seed = "{HASH_SEED}"',
    ]
    for pod in pods:
        lines += [
            "",
            "[[pods]]",
            f'id = "{pod.pod_id}"',
            f'endpoint = "{pod.endpoint}"',
            f'model = "{pod.model}"',
            f"dp_rank = {pod.dp_rank}",
        ]
        if pod.replay_endpoint is not None:
            lines.append(f'replay = "{pod.replay_endpoint}"')
    lines += [
        "",
        "[ingest]",
        "num_workers = 1",
        f"quiet_probe_after_s = {knobs.quiet_probe_after_s}",
        f"replay_timeout_s = {knobs.replay_timeout_s}",
        f"hash_check_every = {knobs.hash_check_every}",
    ]
    return "\n".join(lines) + "\n"


class ProcessSubject(KvindexService):
    """kvindex as `python -m kvindex serve`: SIGSTOP stalls it, SIGKILL kills it, `start` runs a new one."""

    def __init__(self, config_text: str, *, startup_timeout_s: float = 60.0) -> None:
        super().__init__([], model=MODEL, startup_timeout_s=startup_timeout_s)
        self.config_text = config_text
        # The config file has no key for it: kvindex serve redials with IngestSettings' default cap.
        self.reconnect_cap_s = IngestSettings().reconnect_ivl_max_ms / 1000
        self._stopped = False

    def start(self) -> None:
        if self._config_dir is None:
            self._config_dir = tempfile.TemporaryDirectory(prefix="kvindex-faults-")
        config_path = Path(self._config_dir.name) / "serve.toml"
        config_path.write_text(self.config_text)
        if self._log is not None:
            self._log.close()
        self._log = tempfile.TemporaryFile()
        command = [
            sys.executable,
            "-m",
            "kvindex",
            "serve",
            "--http",
            "127.0.0.1:0",
            "--config",
            str(config_path),
        ]
        # KVINDEX_FAULTS_LOG=info and KVINDEX_FAULTS_LOG_DUMP=FILE keep a failing schedule's serve log.
        command += ["--log-level", os.environ.get("KVINDEX_FAULTS_LOG", "warning")]
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._log, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
        try:
            self.port = self.read_port("kvindex serve", self.startup_timeout_s)
            self.client = JsonClient(self.port)
            self.client.request("GET", "/healthz")  # printed once HTTP is up; raises if it is not
        except BaseException:
            self.stop()
            raise

    def stall(self) -> bool:
        os.kill(self.pid, signal.SIGSTOP)
        self._stopped = True
        return True

    def resume(self) -> None:
        if self._stopped:
            os.kill(self.pid, signal.SIGCONT)
            self._stopped = False

    def crash(self) -> None:
        if self._process is None:
            return
        self.resume()
        self._process.kill()  # SIGKILL
        self._process.wait(15)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._process = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def view(self, universe: Collection[int]) -> dict[PodKey, PodView]:
        if self.client is None:
            return {}
        client = self.client
        claims: dict[PodKey, set[int]] = {}
        for block_hash in sorted(universe):
            body = json.dumps({"model": MODEL, "block_hashes": [block_hash]}).encode()
            for score in client.request("POST", "/v1/score", body)["scores"]:
                if score["by_tier"].get(TIER_GPU, 0) >= 1:
                    claims.setdefault((score["pod"], score["dp_rank"]), set()).add(block_hash)
        return {
            (row["pod"], row["dp_rank"]): PodView(
                state=row["state"],
                partial_view=bool(row.get("partial_view", False)),
                last_seq=row.get("last_seq"),
                claims=frozenset(claims.get((row["pod"], row["dp_rank"]), ())),
                detail=status_detail(row),
            )
            for row in client.request("GET", "/v1/pods")["pods"]
        }

    def diagnostics(self) -> list[str]:
        return [] if self.client is not None else ["kvindex serve is not running"]

    def close(self) -> None:
        self.resume()
        dump = os.environ.get("KVINDEX_FAULTS_LOG_DUMP")
        if dump and self._log is not None:
            self._log.seek(0)
            with open(dump, "ab") as out:
                out.write(self._log.read())
        self.stop()
