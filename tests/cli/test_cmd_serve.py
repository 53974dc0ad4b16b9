"""`kvindex serve` as a real process: prints its bound address, serves, and stops cleanly on SIGTERM and
SIGINT (exit 0, no traceback)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kvindex.api import answer as answer_writer
from kvindex.api import id_arrays as request_reader
from kvindex.hashing import BlockHasher, compiled
from kvindex.indexer import compiled as index_core
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import BlockStored
from waiting import wait_for

LISTENING = "kvindex serve: listening on "
TOKENS = list(range(1, 33))


@pytest.fixture
def engine() -> Iterator[EventPublisher]:
    publisher = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        yield publisher
    finally:
        publisher.close()


def read_line(proc: subprocess.Popen[str], timeout_s: float, *, stderr: bool = False) -> str:
    """The next stdout (or stderr) line, or fail after `timeout_s` (never blocks forever)."""
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                return stream.readline()
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
    # The start-up lines an operator checks the settings with.
    assert "model m: block size 16, hash algo sha256, seed '0' (PYTHONHASHSEED), root " in stderr
    assert stderr.count("block hashing: ") == 1 and compiled.describe() in stderr  # which hash core runs
    assert stderr.count("block index: ") == 1 and index_core.describe() in stderr  # which index core runs
    assert stderr.count("score request ids: ") == 1 and request_reader.describe() in stderr
    assert stderr.count("score answers: ") == 1 and answer_writer.describe() in stderr
    assert (
        f"pod pod-a dp rank 0 (model m, from --pod): events {engine.endpoint}, replay {engine.replay_endpoint}"
        in stderr
    )


def stderr_lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """Every stderr line of `proc`, read by a thread (a selector cannot see text already buffered)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stream = proc.stderr

    def pump() -> None:
        with stream:  # closed at the end of stream, which comes once the process has exited
            for text in stream:
                lines.put(text)
        lines.put("")  # end of stream

    threading.Thread(target=pump, name="serve-stderr", daemon=True).start()
    return lines


def sigterm_and_drain(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> list[str]:
    """SIGTERM `proc`, expect exit 0, and return the stderr lines its pump had not handed out yet (kills it
    if it did not stop; closes stdout)."""
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    rest: list[str] = []
    while (text := lines.get(timeout=10)) != "":
        rest.append(text)
    return rest


def status_of(url: str, *, authorization: str | None = None, body: bytes | None = None) -> int:
    headers = {} if authorization is None else {"Authorization": authorization}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=body, headers=headers), timeout=10
        ) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_serve_api_key_flag_beats_the_variable_and_neither_is_logged(engine: EventPublisher) -> None:
    """`kvindex serve --api-key` with KVINDEX_API_KEY also set, at debug level (access log on): the flag's
    key opens /v1/*, the variable's does not, health stays open, and stderr never shows either key."""
    flag_key, env_key = "kvi-flag-7c1d0e9f3a5b", "kvi-env-2b8e6f4d1c0a"
    pod = f"pod-a={engine.endpoint},replay={engine.replay_endpoint}"
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m", "--pod", pod]
    argv += ["--api-key", flag_key, "--log-level", "debug"]
    env = {**os.environ, "PYTHONHASHSEED": "0", "KVINDEX_API_KEY": env_key}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = stderr_lines(proc)
    try:
        line = read_line(proc, 30.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        score_body = json.dumps({"model": "m", "token_ids": TOKENS}).encode()
        assert status_of(url + "/healthz") == 200
        assert status_of(url + "/metrics") == 200
        assert status_of(url + "/v1/pods") == 401
        assert status_of(url + "/v1/pods", authorization=f"Bearer {env_key}") == 401
        assert status_of(url + "/v1/score", authorization=f"Bearer {env_key}", body=score_body) == 401
        assert status_of(url + "/v1/pods", authorization=f"Bearer {flag_key}") == 200
        assert status_of(url + "/v1/score", authorization=f"Bearer {flag_key}", body=score_body) == 200
    finally:
        stderr = sigterm_and_drain(proc, lines)
    log = "".join(stderr)
    assert "HTTP API: /v1/* requires the API key (from --api-key)" in log
    assert '"POST /v1/score HTTP/1.1" 401' in log  # the access log saw the refused requests ...
    assert flag_key not in log and env_key not in log  # ... and neither key
    assert "Traceback" not in log


def stored_tokens() -> tuple[list[int], BlockStored]:
    """TOKENS' two blocks as an engine with --hash-seed 0 stores them: their event hashes and the event."""
    block_keys = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(TOKENS)
    stored = BlockStored(
        block_hashes=block_keys,
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return block_keys, stored


def post_json(url: str, body: object) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


@pytest.mark.parametrize(
    ("flags", "loop_line", "fast_score"),
    [
        ([], f"event loop: uvloop {importlib.metadata.version('uvloop')}", True),
        (["--event-loop", "asyncio"], "event loop: asyncio (--event-loop asyncio)", True),
        (["--log-level", "debug"], f"event loop: uvloop {importlib.metadata.version('uvloop')}", False),
    ],
    ids=["auto-uvloop", "asyncio", "debug-log-no-fast-path"],
)
def test_serve_answers_scores_on_the_event_loop_it_names(
    engine: EventPublisher, flags: list[str], loop_line: str, fast_score: bool
) -> None:
    """The event loop the HTTP API runs on, and whether plain scores take the fast path, are logged at
    start-up; every combination answers the same score for what an engine published, then stops cleanly."""
    pod = f"pod-a={engine.endpoint},replay={engine.replay_endpoint}"
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m", "--pod", pod]
    argv += ["--hash-seed", "0", *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = stderr_lines(proc)
    try:
        line = read_line(proc, 30.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        block_keys, stored = stored_tokens()
        engine.publish([stored])
        matched: list[object] = []

        def scored() -> bool:
            answer = post_json(url + "/v1/score", {"model": "m", "token_ids": TOKENS})
            matched[:] = [(s["pod"], s["matched_blocks"]) for s in answer["scores"]]  # type: ignore[attr-defined,index]
            return bool(matched)

        wait_for(scored, timeout_s=30.0, what="pod-a in the score's answer", poll_s=0.05)
        assert matched == [("pod-a", 2)]
        by_hash = post_json(url + "/v1/score", {"model": "m", "block_hashes": block_keys[:1]})
        assert [(s["pod"], s["matched_blocks"], s["state"]) for s in by_hash["scores"]] == [  # type: ignore[attr-defined,index]
            ("pod-a", 1, "live")
        ]
        request = urllib.request.Request(url + "/v1/score", data=json.dumps({"block_hashes": [1]}).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            assert (response.headers["Server"] == "kvindex") is fast_score  # who answered (api/site.py)
    finally:
        log = "".join(sigterm_and_drain(proc, lines))
    assert loop_line in log
    assert f"score fast path: {'on' if fast_score else 'off'} (" in log
    assert "Traceback" not in log


def test_serve_binds_one_listen_per_dp_rank() -> None:
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m"]
    argv += ["--hash-seed", "0", "--listen", "tcp://127.0.0.1:*", "--listen", "tcp://127.0.0.1:*"]
    argv += ["--switch-interval-ms", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = stderr_lines(proc)
    publisher = None
    try:
        line = read_line(proc, 30.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        bound: list[str] = []
        startup_log: list[str] = []
        while len(bound) < 2:
            log_line = log.get(timeout=30.0)
            assert log_line, f"kvindex serve exited: {''.join(startup_log)}"
            startup_log.append(log_line)
            match = re.search(r"listening for engines on tcp://127\.0\.0\.1:\* \(bound (\S+)\)", log_line)
            if match:
                bound.append(match.group(1))
        assert "model m: block size 16, hash algo sha256, seed '0' (--hash-seed)" in "".join(startup_log)
        assert "GIL switch interval 2 ms" in "".join(startup_log)
        # Rank 1 of an engine configured with port P dials P + 1 (vLLM's DP offset): aim it at the second.
        host, _, port = bound[1].rpartition(":")
        publisher = EventPublisher(f"{host}:{int(port) - 1}", topic="kv@pod-x@m", dp_rank=1)
        assert publisher.endpoint == bound[1]
        block_keys, stored = stored_tokens()
        seen: list[object] = []

        def listed() -> bool:
            # A dialling PUB drops what it sends before our subscription reaches it: publish until seen.
            assert publisher is not None and publisher.publish([stored])
            _, pods = get(url + "/v1/pods")
            seen[:] = [(p["pod"], p["dp_rank"], p["endpoint"]) for p in pods["pods"]]  # type: ignore[index]
            return bool(seen)

        wait_for(listed, timeout_s=30.0, what="rank 1 in /v1/pods", poll_s=0.05)
        assert seen == [("pod-x", 1, bound[1])]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if publisher is not None:
            publisher.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()  # stderr is closed by its reader (stderr_lines)


def test_serve_warns_about_a_pod_host_that_does_not_resolve_and_keeps_serving() -> None:
    """`.invalid` never resolves (RFC 6761): a WARNING names the pod and the host; the server still
    serves (DNS may come up later in Kubernetes) and an IP literal is never looked up."""
    pods = [
        "--pod",
        "pod-a=tcp://pod-a.no-such-host.invalid:5557,replay=tcp://pod-a.no-such-host.invalid:5558",
    ]
    pods += ["--pod", "pod-b=tcp://127.0.0.1:1"]
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m", *pods]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = stderr_lines(proc)
    try:
        line = read_line(proc, 30.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        seen: list[str] = []
        while not any("WARNING" in text for text in seen):
            text = log.get(timeout=30.0)
            assert text, f"kvindex serve exited: {''.join(seen)}"
            seen.append(text)
        (warning,) = [text for text in seen if "WARNING" in text]
        assert "host 'pod-a.no-such-host.invalid' does not resolve" in warning
        assert "pod 'pod-a' dp rank 0 (events), pod 'pod-a' dp rank 0 (replay)" in warning
        assert get(url + "/healthz")[0] == 200
    finally:
        rest = sigterm_and_drain(proc, log)
    assert not [text for text in seen + rest if "127.0.0.1" in text and "WARNING" in text]
    assert not [text for text in rest if "Traceback" in text]


def test_serve_with_a_thousand_pods_stops_within_the_deadline() -> None:
    """SIGTERM with 1,000 pods dialled and their joins outstanding: every ingest thread joins within the
    stop deadline (the service logs 'did not stop within' otherwise) and the process exits 0."""
    pods: list[str] = []
    for i in range(1000):
        pods += ["--pod", f"pod-{i}=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:1"]  # nothing listens on port 1
    argv = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--model", "m", *pods]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = stderr_lines(proc)  # a thousand start-up lines would fill the pipe and stall the server
    try:
        line = read_line(proc, 60.0)
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING) :].strip()
        status, body = get(url + "/v1/pods")
        assert status == 200 and len(body["pods"]) == 1000  # type: ignore[arg-type]
    finally:
        stderr = sigterm_and_drain(proc, lines)
    assert not [text for text in stderr if "Traceback" in text or "did not stop within" in text]
    assert any("stopped" in text for text in stderr[-3:])
