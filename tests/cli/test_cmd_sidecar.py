"""`kvindex sidecar` and `kvindex serve` as real processes beside an engine (the project's vLLM-identical
publisher on 127.0.0.1): the README's bind-mode wiring (the sidecar dials the central's --listen), the
central killed while more batches than the sidecar's ring pass, restarted, and exact again from the
snapshot; both stop cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO, Any

import pytest
from engines import Engine
from waiting import wait_for

RING = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def ready(url: str) -> bool:
    try:
        return bool(get(url + "/readyz")["ready"])
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
        exc.close()
        return False


class Proc:
    """A kvindex subprocess with its stderr in a file (never a pipe that could fill) and its first stdout
    line (the listening address)."""

    def __init__(self, argv: list[str], marker: str) -> None:
        self.log: IO[str] = tempfile.TemporaryFile("w+")
        # The engine hashes with PYTHONHASHSEED unset (vLLM's rule): so do sidecar and central.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvindex", *argv],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + 30
            line = ""
            while time.monotonic() < deadline and not line:
                if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = self.proc.stdout.readline()
        assert line.startswith(marker), (line, self.stderr())
        self.url = line[len(marker) :].strip()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        text = self.stderr()
        self.log.close()
        return text


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for proc in made:
        if proc.proc.poll() is None:
            proc.stop()


def publish(engine: Engine, n: int) -> None:
    for i in range(n):
        engine.store_prompt(num_blocks=1 + i % 3)
        if i % 4 == 3:
            engine.remove_oldest()
    engine.flush()


def test_engine_sidecar_serve_by_hand_survive_a_central_outage_longer_than_the_ring(
    engines: list[Engine], procs: list[Proc]
) -> None:
    engines.append(Engine("pod-a"))
    engine = engines[0]
    listen, replay, http = free_port(), free_port(), free_port()
    serve_argv = [
        "serve", "--http", "127.0.0.1:0", "--model", "m",
        "--listen", f"tcp://127.0.0.1:{listen}",
        "--listen-replay", f"tcp://127.0.0.1:{replay}",
        "--listen-snapshot", f"http://127.0.0.1:{http}/v1/snapshot",
    ]  # fmt: skip
    central = Proc(serve_argv, "kvindex serve: listening on ")
    procs.append(central)
    sidecar = Proc(
        [
            "sidecar", "--pod", "pod-a", "--model", "m", "--buffer-steps", str(RING),
            "--engine", engine.endpoint, "--engine-replay", engine.replay_endpoint or "",
            "--publish", f"tcp://127.0.0.1:{listen}", "--replay", f"tcp://127.0.0.1:{replay}",
            "--http", f"127.0.0.1:{http}",
        ],
        "kvindex sidecar: listening on ",
    )  # fmt: skip
    procs.append(sidecar)
    wait_for(lambda: ready(sidecar.url), what="the sidecar joined its engine")

    def central_exact(url: str) -> bool:
        pods = get(url + "/v1/pods")["pods"]
        status = get(sidecar.url + "/v1/status")["ranks"][0]
        return bool(
            pods
            and pods[0]["state"] == "live"
            and not pods[0]["partial_view"]
            and pods[0]["blocks"] == len(engine.held) == status["blocks"]
            and pods[0]["last_seq"] == status["downstream_seq"]
        )

    publish(engine, 6)
    wait_for(lambda: central_exact(central.url), timeout_s=30, what="the central to follow the sidecar")
    assert "stopped" in central.stop()
    publish(engine, 4 * RING)  # the central is down: more than the sidecar's ring passes
    wait_for(
        lambda: get(sidecar.url + "/v1/status")["ranks"][0]["downstream_seq"] == engine.publisher.last_seq,
        what="the sidecar to relay everything",
    )
    central = Proc(serve_argv, "kvindex serve: listening on ")
    procs.append(central)
    publish(engine, 1)  # bind mode: the pod exists for the central once a batch arrives
    wait_for(
        lambda: central_exact(central.url), timeout_s=30, what="the restarted central exact from the snapshot"
    )
    with urllib.request.urlopen(central.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvindex_snapshot_loads_total{outcome="ok"} 1.0' in metrics
    with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as response:
        sidecar_metrics = response.read().decode()
    assert 'kvindex_sidecar_hash_mismatches_total{dp_rank="0",model="m",pod="pod-a"} 0.0' in sidecar_metrics
    snapshot = get_json_snapshot(sidecar.url)
    assert {k for t in snapshot["ranks"][0]["tiers"] for k in t["block_hashes"]} == set(engine.held)
    for proc in (central, sidecar):
        text = proc.stop()
        assert proc.proc.returncode == 0 and "Traceback" not in text, text


def get_json_snapshot(url: str) -> Any:
    request = urllib.request.Request(url + "/v1/snapshot", headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        return json.loads(response.read())
