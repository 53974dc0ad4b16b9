"""A real `redis-server` on a free 127.0.0.1 port, for the tests and the store benchmark: started without
persistence (`--save '' --appendonly no`), so a restart comes back empty, as a crashed cache server does.
`RedisClusterServers`: three such servers formed into a Redis Cluster (three masters, no replicas).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self

REDIS_SERVER = "redis-server"
CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000


def redis_server_path() -> str | None:
    return shutil.which(REDIS_SERVER)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, Redis' fixed offset) is free and valid too."""
    while True:
        port = _free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
        except OSError:
            continue
        return port


class _Started:
    """`with` starts it and closes it (its `start` and `close`)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RedisServer(_Started):
    """One redis-server process; `stop`, `start` (on the same port, empty) and `kill` for fault tests."""

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        path = redis_server_path()
        if path is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.path = path
        self.port = port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-redis-")
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            return
        self.process = subprocess.Popen(
            [
                self.path,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
                "--protected-mode", "no",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s} s")
            time.sleep(0.02)  # ok: polling a starting server under a deadline

    def stop(self) -> None:
        """SIGTERM and wait (no persistence: the next start is empty)."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


class RedisClusterServers(_Started):
    """A real Redis Cluster of `size` masters on free 127.0.0.1 ports, no replicas: each node owns one
    contiguous range of the 16384 slots. Formed with CLUSTER ADDSLOTSRANGE and CLUSTER MEET (no redis-cli
    needed); `start` returns once every node reports `cluster_state:ok`."""

    def __init__(self, size: int = 3) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-redis-cluster-")
        self.servers: list[RedisServer] = []
        for _ in range(size):
            port = _free_cluster_port()
            config = f"{self._dir.name}/nodes-{port}.conf"
            args = ("--cluster-enabled", "yes", "--cluster-config-file", config)
            self.servers.append(RedisServer(port, extra_args=args))

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]

    @property
    def url(self) -> str:
        """The explicit cluster URL, naming the first node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    @property
    def plain_url(self) -> str:
        """A plain `redis://` URL of the first node, which kvindex detects as a cluster."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start and form the cluster; on any failure stop every node started (none outlives a test)."""
        try:
            for server in self.servers:
                server.start()
            self._assign_slots()
            for port in self.ports[1:]:
                self._command(self.ports[0], "CLUSTER", "MEET", "127.0.0.1", str(port))
            self._await_ok(timeout_s)
        except BaseException:
            self.close()
            raise

    def _assign_slots(self) -> None:
        size = len(self.servers)
        for number, port in enumerate(self.ports):
            first = number * CLUSTER_SLOTS // size
            last = (number + 1) * CLUSTER_SLOTS // size - 1
            self._command(port, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))

    def _await_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(b"cluster_state:ok" in self._command(port, "CLUSTER", "INFO") for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster on ports {self.ports} did not form in {timeout_s} s")
            time.sleep(0.05)  # ok: polling a forming cluster under a deadline

    def slot_owner(self, slot: int) -> int:
        """The port of the node serving `slot` (the slots were split evenly, in port order)."""
        return self.ports[slot * len(self.servers) // CLUSTER_SLOTS]

    def key_slot(self, key: str) -> int:
        return int(self._command(self.ports[0], "CLUSTER", "KEYSLOT", key))

    def flush(self) -> None:
        for port in self.ports:
            self._command(port, "FLUSHALL")

    def _command(self, port: int, *words: str) -> bytes:
        """One command over a raw socket (RESP), so this helper needs neither redis-py nor redis-cli."""
        request = f"*{len(words)}\r\n".encode() + b"".join(
            f"${len(word.encode())}\r\n{word}\r\n".encode() for word in words
        )
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            return _read_reply(sock)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self._dir.cleanup()


def _read_reply(sock: socket.socket) -> bytes:
    """One RESP reply of a simple kind (status, error, integer, bulk string) as its payload bytes."""
    reader = sock.makefile("rb")
    line = reader.readline().rstrip(b"\r\n")
    kind, body = line[:1], line[1:]
    if kind == b"-":
        raise RuntimeError(f"redis: {body.decode()}")
    if kind == b"$":
        length = int(body)
        return b"" if length < 0 else reader.read(length + 2)[:length]
    return body
