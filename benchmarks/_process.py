"""A benchmarked service running as its own process: started, awaited, measured (RSS) and always stopped.

Shared by `kvindex serve` (benchmarks/service.py), Dynamo's indexer (benchmarks/dynamo.py) and the
measurement floor (benchmarks/floor.py), so every subject is handled — and its memory read — the same way.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, ParamSpec, Self, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# What a server of ours prints once it accepts connections (`kvindex serve`, benchmarks/floor.py).
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def await_condition(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Return once `condition()` is true; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)  # ok: polling helper with a deadline


def in_fresh_process(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`function(*args, **kwargs)` in a new interpreter (spawned, not forked), for a measurement that the
    state this process has built up (its heap, its caches) must not colour."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args, **kwargs).result()


def process_rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"VmRSS missing from /proc/{pid}/status")


class ManagedProcess:
    """Owns one subprocess and its log file; subclasses implement `start` and may extend `stop`."""

    _process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        assert self._process is not None, "not started"
        return self._process.pid

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, wait, SIGKILL if it lingers; close the log. Idempotent."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
                try:
                    self._process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait(timeout_s)
            if self._process.stdout is not None:
                self._process.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def read_port(self, what: str, timeout_s: float) -> int:
        """The port in the process's `listening on http://127.0.0.1:PORT` line on stdout; RuntimeError if it
        exits first (with its log), TimeoutError after `timeout_s`."""
        assert self._process is not None and self._process.stdout is not None
        deadline = time.monotonic() + timeout_s
        seen = b""
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"{what} exited with {self._process.returncode}: {self.log_tail()}")
            ready, _, _ = select.select([self._process.stdout], [], [], 0.2)
            if ready:
                seen += os.read(self._process.stdout.fileno(), 4096)
                match = LISTENING.search(seen.decode(errors="replace"))
                if match:
                    return int(match[1])
        raise TimeoutError(f"{what} printed no listening line in {timeout_s:.0f}s")

    def log_tail(self, num_bytes: int = 2000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - num_bytes))
        return self._log.read().decode(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the service process."""
        assert self._process is not None, "not started"
        return process_rss_bytes(self._process.pid)


def run_main(main: Callable[[], int], stopped: str) -> None:
    """Run a benchmark's `main` as the process: SIGTERM unwinds like Ctrl-C (SystemExit runs every context
    manager, so whatever `main` started is stopped), and an interrupt says what was stopped."""

    def exit_on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"interrupted; {stopped}", file=sys.stderr)
        sys.exit(130)
