"""benchmarks/floor.py: the canned-answer server the score rows are measured against, run as the benchmark
runs it (its own process, on 127.0.0.1), asked over a real socket and by the benchmark's own client."""

from __future__ import annotations

import socket

import pytest

from benchmarks.floor import CFloorServer, FloorServer, response_bytes
from benchmarks.service import JsonClient

pytestmark = pytest.mark.timeout(60)

ANSWER = b'[["engine-0",0,12,12.0],["engine-1",0,3,3.0]]'


def post(body: bytes) -> bytes:
    return b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


@pytest.mark.parametrize("server", [FloorServer, CFloorServer])
def test_every_request_gets_the_canned_answer_once_its_body_is_complete(
    server: type[FloorServer],
) -> None:
    response = response_bytes(ANSWER)
    with (
        server(ANSWER) as floor,
        socket.create_connection(("127.0.0.1", floor.port), timeout=10) as sock,
    ):
        # Two pipelined requests in one write, then one whose body comes in two writes.
        sock.sendall(post(b'{"token_ids": [1, 2, 3]}') + post(b"{}"))
        assert read_exactly(sock, 2 * len(response)) == 2 * response
        split = post(b'{"block_hashes": [' + b"7," * 5000 + b"8]}")
        sock.sendall(split[:-100])
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing yet: the body is incomplete
        sock.settimeout(10)
        sock.sendall(split[-100:])
        assert read_exactly(sock, len(response)) == response


@pytest.mark.parametrize("server", [FloorServer, CFloorServer])
def test_the_benchmark_client_reads_the_answer_it_was_given(server: type[FloorServer]) -> None:
    with server(ANSWER) as floor:
        client = JsonClient(floor.port)
        try:
            for _ in range(3):
                assert client.request("POST", "/v1/score", b'{"token_ids": [5]}') == [
                    ["engine-0", 0, 12, 12.0],
                    ["engine-1", 0, 3, 3.0],
                ]
        finally:
            client.close()


def test_the_c_floor_reads_a_request_larger_than_its_first_buffer() -> None:
    response = response_bytes(ANSWER)
    big = post(b'{"token_ids": [' + b"1," * 200_000 + b"2]}")  # ~400 KB: several reads and buffer growths
    with (
        CFloorServer(ANSWER) as floor,
        socket.create_connection(("127.0.0.1", floor.port), timeout=10) as sock,
    ):
        sock.sendall(big + post(b"{}"))
        assert read_exactly(sock, 2 * len(response)) == 2 * response


def test_the_c_floor_names_a_missing_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-kvindex")
    with pytest.raises(RuntimeError, match="no C compiler"):
        CFloorServer(ANSWER).start()
