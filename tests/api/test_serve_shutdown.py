"""`kvindex serve` as a real process: prints its bound address, serves, and stops cleanly on SIGTERM and
SIGINT (exit 0, no traceback)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from kvindex.replay.publisher import EventPublisher

LISTENING = "kvindex serve: listening on "


@pytest.fixture
def engine() -> Iterator[EventPublisher]:
    publisher = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        yield publisher
    finally:
        publisher.close()


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next stdout line, or fail after `timeout_s` (never blocks forever)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                return proc.stdout.readline()
    raise AssertionError(f"no output from kvindex serve within {timeout_s}s")


def get(url: str) -> tuple[int, dict[str, object]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, json.loads(response.read())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stops_cleanly_on_signal(engine: EventPublisher, signum: int) -> None:
    pod = f"pod-a={engine.endpoint},replay={engine.replay_endpoint}"
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m", "--pod", pod]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = read_line(proc, 30.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        assert get(url + "/healthz")[0] == 200
        status, pods = get(url + "/v1/pods")
        assert status == 200 and [p["pod"] for p in pods["pods"]] == ["pod-a"]  # type: ignore[index]
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "stopped" in stderr  # the shutdown log line
