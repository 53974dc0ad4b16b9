"""A real `redis-server` on a free 127.0.0.1 port, for the tests and the store benchmark: started without
persistence (`--save '' --appendonly no`), so a restart comes back empty, as a crashed cache server does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

REDIS_SERVER = "redis-server"


def redis_server_path() -> str | None:
    return shutil.which(REDIS_SERVER)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process; `stop`, `start` (on the same port, empty) and `kill` for fault tests."""

    def __init__(self, port: int | None = None) -> None:
        path = redis_server_path()
        if path is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.path = path
        self.port = port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-redis-")
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

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
