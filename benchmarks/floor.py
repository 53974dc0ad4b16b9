"""The measurement floor of the score rows: a server that does no work, timed in turn with the services.

It frames each HTTP/1.1 request as any server must (the head up to its blank line, then Content-Length bytes
of body) and writes one canned answer, without reading the body: kvindex's own answer to the workload's
first prompt, so the bytes on the wire are the size of a real answer. On kvindex's event loop (uvloop when
installed), in its own process, asked by the same keep-alive client in the same alternating order as kvindex
and Dynamo, it shows what the client, loopback and the shared two cores cost on their own. A score p99 near
the floor's is the instrument's, not the service's: on this box the floor's 512-hash p99 is 0.40-0.79x
Dynamo's through the lean TimedClient (~0.45x through http.client before it), and issue 14's goal for that
row is <= 0.5x. Where the scheduler wakes each server decides most of it, and it wakes a server that does
no work on its client's CPU, where a server doing a score's work mostly is not (benchmarks/wake.py).

`python -m benchmarks.floor ANSWER_FILE [WORK_US]` prints `listening on http://127.0.0.1:PORT` and serves until
killed; FloorServer runs it as a subprocess. WORK_US (default 0) keeps the CPU busy that long before each
answer, as computing one would: benchmarks/wake.py asks servers that differ only in it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

from kvindex.cli.process import event_loop_factory

from benchmarks._process import ManagedProcess

_HEAD_END = b"\r\n\r\n"
_LENGTH = b"content-length:"


class _CannedAnswer(asyncio.Protocol):
    """Answers every complete request on the connection with `response`."""

    def __init__(self, response: bytes, work_s: float = 0.0) -> None:
        self._response = response
        self._work_s = work_s
        self._buffer = b""
        self._transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(_HEAD_END)) >= 0:
            head = self._buffer[:end].lower()
            at = head.find(_LENGTH)
            length = int(head[at + len(_LENGTH) :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            request_end = end + len(_HEAD_END) + length
            if len(self._buffer) < request_end:
                return
            self._buffer = self._buffer[request_end:]
            if self._work_s:
                deadline = time.perf_counter() + self._work_s
                while time.perf_counter() < deadline:
                    pass
            assert self._transport is not None
            self._transport.write(self._response)


def response_bytes(answer: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nServer: floor\r\n\r\n"
        % len(answer)
    ) + answer


async def _serve(answer: bytes, work_s: float) -> None:
    loop = asyncio.get_running_loop()
    response = response_bytes(answer)
    server = await loop.create_server(lambda: _CannedAnswer(response, work_s), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await server.serve_forever()


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2):
        raise SystemExit("usage: python -m benchmarks.floor ANSWER_FILE [WORK_US]")
    answer = Path(argv[0]).read_bytes()
    work_s = float(argv[1]) / 1e6 if len(argv) == 2 else 0.0
    factory, _ = event_loop_factory("auto")
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(answer, work_s))


class FloorServer(ManagedProcess):
    """`python -m benchmarks.floor` in a subprocess answering `answer` (after `work_us` of busy work); `port`
    once started."""

    _name = "the floor server"

    def __init__(self, answer: bytes, startup_timeout_s: float = 30.0, work_us: float = 0.0) -> None:
        self.answer = answer
        self._work_us = work_us
        self._startup_timeout_s = startup_timeout_s
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0

    def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-floor-")
        try:
            command = self._command(Path(self._dir.name))
            self._log = tempfile.TemporaryFile()
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log)
            self.port = self.read_port(self._name, self._startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _command(self, workdir: Path) -> list[str]:
        """The server's command line, its inputs written to `workdir` (removed at stop)."""
        answer_file = workdir / "answer.json"
        answer_file.write_bytes(self.answer)
        return [sys.executable, "-m", "benchmarks.floor", str(answer_file), str(self._work_us)]

    def stop(self, timeout_s: float = 15.0) -> None:
        super().stop(timeout_s)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


C_FLOOR_SOURCE = Path(__file__).with_name("c_floor.c")


class CFloorServer(FloorServer):
    """The floor without Python (benchmarks/c_floor.c, compiled here by $CC or cc): one thread in epoll,
    the same framing and the same response bytes as FloorServer's. Beside the Python floor it shows what
    Python and its event loop add to a server that does no work. RuntimeError without a C compiler."""

    _name = "the C floor server"

    def __init__(self, answer: bytes, startup_timeout_s: float = 30.0) -> None:
        super().__init__(answer, startup_timeout_s)

    def _command(self, workdir: Path) -> list[str]:
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            raise RuntimeError("no C compiler ($CC or cc) to build the C floor")
        binary = workdir / "c_floor"
        built = subprocess.run(
            [compiler, "-O2", "-o", str(binary), str(C_FLOOR_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if built.returncode != 0:
            raise RuntimeError(f"the C floor did not compile: {built.stderr.strip()[-500:]}")
        response_file = workdir / "response"
        response_file.write_bytes(response_bytes(self.answer))
        return [str(binary), str(response_file)]


if __name__ == "__main__":
    main(sys.argv[1:])
