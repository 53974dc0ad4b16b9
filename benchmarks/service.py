"""A real `kvindex serve` process as a benchmark subject, and the one HTTP client every service is timed with.

`KvindexService` writes a TOML config naming every engine's PUB endpoint, starts
`python -m kvindex serve --http 127.0.0.1:0 --config FILE` as a subprocess, reads back its port, and drives
its HTTP API (/v1/pods for per-pod last_seq, /v1/score). `JsonClient` is a keep-alive http.client
connection for the services' control requests; `TimedClient` is the one keep-alive connection every timed
score request goes through, kvindex, Dynamo and the floor alike.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks._process import ManagedProcess, await_condition


class JsonClient:
    """One persistent HTTP/1.1 connection to 127.0.0.1:port; reconnects once if the server closed it."""

    def __init__(self, port: int, timeout_s: float = 30.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None) -> Any:
        """Send `body` (already-encoded JSON) and return the decoded JSON answer; 4xx/5xx raise."""
        headers = {} if body is None else {"content-type": "application/json"}
        for attempt in (0, 1):
            if self._connection is None:
                self._connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
            try:
                self._connection.request(method, path, body=body, headers=headers)
                response = self._connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                continue
            if response.status >= 400:
                raise RuntimeError(f"{method} {path} -> {response.status}: {data[:300]!r}")
            return json.loads(data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class TimedClient:
    """One persistent HTTP/1.1 connection to 127.0.0.1:port that times a POST from its first byte sent to
    its answer's last byte received, and decodes nothing inside that window.

    A router is a compiled client; http.client is not: parsing each answer's head with email.parser, it
    added ~0.15 ms to every round trip here (the floor's 512-hash p50: 0.18 ms through http.client, 0.03 ms
    through this), the same for every service, so it pulled every latency ratio toward 1 and put even the
    do-nothing floor at ~0.45-0.5x Dynamo. This client writes the request in one send and reads only the
    answer's status, Content-Length and (if a server chunks) Transfer-Encoding.
    """

    def __init__(self, port: int, timeout_s: float = 30.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._pending = b""  # bytes received past the previous answer (none from a well-behaved server)

    def post(self, path: str, body: bytes) -> tuple[float, bytes]:
        """(seconds from sending to the answer's last byte, the answer's body); 4xx/5xx raise. A connection
        the server closed is reopened once, outside the timed window."""
        request = (
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode("ascii"), self.port, len(body))
        ) + body
        for attempt in (0, 1):
            sock = self._connect()
            began = time.perf_counter()
            try:
                sock.sendall(request)
                status, data, keep_alive = self._read_answer(sock)
            except OSError:  # ConnectionError included
                self.close()
                if attempt:
                    raise
                continue
            elapsed = time.perf_counter() - began
            if not keep_alive:
                self.close()
            if status >= 400:
                raise RuntimeError(f"POST {path} -> {status}: {data[:300]!r}")
            return elapsed, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pending = b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _read_answer(self, sock: socket.socket) -> tuple[int, bytes, bool]:
        buffer = self._pending
        while (head_end := buffer.find(b"\r\n\r\n")) < 0:
            buffer += _recv(sock)
        status_line, *header_lines = buffer[:head_end].decode("latin-1").split("\r\n")
        version, status = status_line.split(" ", 2)[:2]
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = headers.get("connection") != "close" and version == "HTTP/1.1"
        rest = buffer[head_end + 4 :]
        if headers.get("transfer-encoding", "identity") != "identity":
            data, self._pending = _read_chunked(sock, rest)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            while len(rest) < length:
                rest += _recv(sock)
            data, self._pending = rest[:length], rest[length:]
        else:  # the body runs to the connection's end
            while chunk := sock.recv(262_144):
                rest += chunk
            data, self._pending, keep_alive = rest, b"", False
        return int(status), data, keep_alive


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(262_144)
    if not chunk:
        raise ConnectionError("the server closed the connection mid-answer")
    return chunk


def _read_chunked(sock: socket.socket, buffer: bytes) -> tuple[bytes, bytes]:
    """A chunked body (its trailers ignored) and the bytes received past it."""
    data = b""
    while True:
        while (line_end := buffer.find(b"\r\n")) < 0:
            buffer += _recv(sock)
        size = int(buffer[:line_end].split(b";", 1)[0], 16)
        buffer = buffer[line_end + 2 :]
        if size == 0:
            while (trailer_end := buffer.find(b"\r\n")) != 0:
                if trailer_end < 0:
                    buffer += _recv(sock)
                else:
                    buffer = buffer[trailer_end + 2 :]
            return data, buffer[2:]
        while len(buffer) < size + 2:
            buffer += _recv(sock)
        data += buffer[:size]
        buffer = buffer[size + 2 :]


def pod_id(engine_index: int) -> str:
    return f"engine-{engine_index}"


def engine_index_of(pod: str) -> int:
    return int(pod.rsplit("-", 1)[1])


def config_toml(
    endpoints: Sequence[str],
    model: str,
    hash_seed: str,
    block_size: int,
    *,
    replay_endpoints: Sequence[str | None] | None = None,
    ingest: Mapping[str, int | float] | None = None,
) -> str:
    """A serve config: one model, one connect-mode pod per engine endpoint (replay sockets only where
    `replay_endpoints` names one), and `ingest` as the file's [ingest] section (e.g. index caps)."""
    if replay_endpoints is not None and len(replay_endpoints) != len(endpoints):
        raise ValueError("replay_endpoints needs one entry (or None) per endpoint")
    lines = [
        "[[models]]",
        f'name = "{model}"',
        f"block_size = {block_size}",
        'hash_algo = "sha256"',
        f'hash_seed = "{hash_seed}"',
    ]
    for index, endpoint in enumerate(endpoints):
        lines += ["", "[[pods]]", f'id = "{pod_id(index)}"', f'endpoint = "{endpoint}"', f'model = "{model}"']
        replay = replay_endpoints[index] if replay_endpoints is not None else None
        if replay is not None:
            lines.append(f'replay = "{replay}"')
    if ingest:
        lines += ["", "[ingest]", *(f"{key} = {value!r}" for key, value in ingest.items())]
    return "\n".join(lines) + "\n"


class KvindexService(ManagedProcess):
    """One `kvindex serve` subprocess subscribed to `endpoints` (engine i is pod `engine-i`, with the replay
    socket `replay_endpoints[i]` if given; `ingest` becomes the config's [ingest] section).

    A context manager: start() returns once HTTP answers and every pod is listed; stop() sends SIGTERM,
    then kills if it lingers, and removes the config file (always, also on errors).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        model: str = "bench",
        hash_seed: str = "0",
        block_size: int = 16,
        python: str | None = None,
        startup_timeout_s: float = 60.0,
        replay_endpoints: Sequence[str | None] | None = None,
        ingest: Mapping[str, int | float] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """`extra_args`: more `kvindex serve` flags (e.g. `--store URL --replica-id r1`)."""
        self.endpoints = list(endpoints)
        self.extra_args = list(extra_args)
        self.replay_endpoints = None if replay_endpoints is None else list(replay_endpoints)
        self.ingest = dict(ingest or {})
        self.model = model
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.python = python or sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.client: JsonClient | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._config_dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        self._config_dir = tempfile.TemporaryDirectory(prefix="kvindex-bench-")
        config_path = Path(self._config_dir.name) / "serve.toml"
        config_path.write_text(
            config_toml(
                self.endpoints,
                self.model,
                self.hash_seed,
                self.block_size,
                replay_endpoints=self.replay_endpoints,
                ingest=self.ingest,
            )
        )
        self._log = tempfile.TemporaryFile()
        command = [
            self.python,
            "-m",
            "kvindex",
            "serve",
            "--http",
            "127.0.0.1:0",
            "--config",
            str(config_path),
        ]
        command += ["--log-level", "warning", *self.extra_args]
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._log, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
        try:
            self.port = self.read_port("kvindex serve", self.startup_timeout_s)
            self.client = JsonClient(self.port)
            await_condition(
                lambda: len(self.pods()) == len(self.endpoints), self.startup_timeout_s, "kvindex's pod list"
            )
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, wait, SIGKILL if it lingers. Idempotent."""
        if self.client is not None:
            self.client.close()
            self.client = None
        super().stop(timeout_s)
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None

    def kill(self) -> None:
        """SIGKILL (no lease released, nothing flushed: a crashed replica), then clean up."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self.stop()

    def _client(self) -> JsonClient:
        assert self.client is not None, "not started"
        return self.client

    def pods(self) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = self._client().request("GET", "/v1/pods")["pods"]
        return pods

    def events_applied(self) -> int:
        """Events applied so far, every kind (GET /v1/ingest: one counter, cheap at any fleet size)."""
        counters = self._client().request("GET", "/v1/ingest")
        return sum(counters["events_applied"].values())

    def last_seqs(self) -> dict[int, int | None]:
        """Engine index -> the last seq kvindex has applied for it (None before the first)."""
        return {engine_index_of(pod["pod"]): pod.get("last_seq") for pod in self.pods()}

    def caught_up(self, last_seq_by_engine: Mapping[int, int]) -> bool:
        seen = self.last_seqs()
        for engine, seq in last_seq_by_engine.items():
            applied = seen.get(engine)
            if applied is None or applied < seq:
                return False
        return True

    def score_body(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        answer: str | None = None,
    ) -> bytes:
        """A /v1/score body; `answer` "compact" asks for [pod, dp_rank, matched_blocks, score] entries."""
        body: dict[str, Any] = {"model": self.model}
        if answer is not None:
            body["answer"] = answer
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        if block_hashes is not None:
            body["block_hashes"] = list(block_hashes)
        return json.dumps(body).encode()

    def score(self, body: bytes) -> dict[int, int]:
        """POST /v1/score with a pre-encoded body: engine index -> matched blocks (0s omitted)."""
        return blocks_per_engine_kvindex(self._client().request("POST", "/v1/score", body))


def blocks_per_engine_kvindex(response: Mapping[str, Any]) -> dict[int, int]:
    """kvindex's /v1/score answer (full or compact) -> engine index -> matched blocks."""
    blocks: dict[int, int] = {}
    for entry in response.get("scores", []):
        pod, matched = (
            (entry[0], entry[2]) if isinstance(entry, list) else (entry["pod"], entry["matched_blocks"])
        )
        if matched > 0:
            blocks[engine_index_of(pod)] = int(matched)
    return blocks


def blocks_per_engine_dynamo(response: Mapping[str, Any], block_size: int) -> dict[int, int]:
    """Dynamo's /query answer ({"scores": {worker_id: {dp_rank: tokens}}}, worker id = engine + 1)."""
    result: dict[int, int] = {}
    for worker_id, by_rank in response.get("scores", {}).items():
        best = max(by_rank.values()) if by_rank else 0
        if best > 0:
            result[int(worker_id) - 1] = best // block_size
    return result
