"""benchmarks/service.py TimedClient, the one client every timed score request goes through: against the
floor server (as the benchmark runs it) and a real aiohttp server answering in every framing HTTP/1.1 has."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from benchmarks.floor import FloorServer
from benchmarks.service import TimedClient

pytestmark = pytest.mark.timeout(60)

ANSWER = b'[["engine-0",0,12,12.0],["engine-1",0,3,3.0]]'


def test_a_keep_alive_connection_times_each_answer_of_the_floor() -> None:
    with FloorServer(ANSWER) as floor:
        client = TimedClient(floor.port)
        try:
            for body in (b'{"token_ids": [5]}', b"{}", b'{"block_hashes": [' + b"7," * 5000 + b"8]}"):
                elapsed, data = client.post("/v1/score", body)
                assert data == ANSWER
                assert 0 < elapsed < 10
        finally:
            client.close()


async def _echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    framing = request.query.get("framing", "length")
    if framing == "error":
        return web.json_response({"error": "no such model"}, status=404)
    if framing == "close":
        return web.Response(body=body, headers={"Connection": "close"})
    if framing == "chunked":
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for at in range(0, len(body), 7):  # many small chunks
            await response.write(body[at : at + 7])
        await response.write_eof()
        return response
    return web.Response(body=body)


@pytest.fixture
def echo_port() -> Iterator[int]:
    """An aiohttp server on its own thread's event loop that answers each POST with its body."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/echo", _echo)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_every_framing_of_an_answer_reads_back_the_bytes_sent(echo_port: int) -> None:
    client = TimedClient(echo_port)
    try:
        for framing in ("length", "chunked", "close", "length", "chunked"):
            body = b'{"framing": "%s", "pad": "%s"}' % (framing.encode(), b"x" * 3000)
            _, data = client.post(f"/echo?framing={framing}", body)
            assert data == body, framing
    finally:
        client.close()


def test_an_error_status_raises_with_the_answer_and_the_connection_stays_usable(echo_port: int) -> None:
    client = TimedClient(echo_port)
    try:
        with pytest.raises(RuntimeError, match=r"-> 404: .*no such model"):
            client.post("/echo?framing=error", b"{}")
        assert client.post("/echo", b'{"again": 1}')[1] == b'{"again": 1}'
    finally:
        client.close()
