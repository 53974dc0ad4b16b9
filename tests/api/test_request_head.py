"""parse_head (api/score_connection.py) against llhttp, the parser httptools wraps and aiohttp's C parser is
built on: every head it takes, llhttp reads to the same target, Content-Length, Authorization and
keep-alive, and declines nothing llhttp would call plain; and the heads real clients send are taken."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection

import aiohttp
import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvindex.api.score_connection import parse_head

NOT_PLAIN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
READ_HEADERS = frozenset({b"content-length", b"authorization", b"connection"})


class LlhttpHead:
    """httptools' callbacks: what llhttp makes of a head."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.keep_alive = False
        self.parser: httptools.HttpRequestParser | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        # Asked here: once a message without a body completes, llhttp resets what it knew of it.
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True


def llhttp_reading(head: bytes) -> tuple[bytes, int, bytes | None, bool] | None:
    """(target, Content-Length, Authorization, keep-alive) of a plain score head as llhttp reads it; None
    where llhttp refuses the head or it is not plain (method, version, path, a header the fast path
    leaves to aiohttp, no or several Content-Lengths, several Authorizations)."""
    fields = LlhttpHead()
    parser = fields.parser = httptools.HttpRequestParser(fields)
    try:
        parser.feed_data(head)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    if not fields.complete or parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
        return None
    if fields.url.partition(b"?")[0] != b"/v1/score":
        return None
    names = [name for name, _ in fields.headers]
    if NOT_PLAIN & set(names) or names.count(b"content-length") != 1 or names.count(b"authorization") > 1:
        return None
    values = dict(fields.headers)
    if not values[b"content-length"].isdigit():
        return None
    return (
        fields.url,
        int(values[b"content-length"]),
        values.get(b"authorization"),
        fields.keep_alive,
    )


def reading(head: bytes) -> tuple[bytes, int, bytes | None, bool] | None:
    parsed = parse_head(head)
    if parsed is None:
        return None
    return parsed.url, parsed.content_length, parsed.authorization, parsed.keep_alive


TARGETS = [
    b"/v1/score",
    b"/v1/score?model=m",
    b"/v1/score?",
    b"/v1/scores",
    b"/v1/score/",
    b"/v1/score#x",
    b"//v1/score",
    b"/V1/score",
    b"http://h/v1/score",
    b"/v1/score?a b",
    b"/v1/score?\xc3\xa9",
    b"/v1/score?a=%20",
    b"*",
]
NAMES = [
    b"Content-Length",
    b"content-length",
    b"CONTENT-LENGTH",
    b"Authorization",
    b"Connection",
    b"Transfer-Encoding",
    b"Expect",
    b"Upgrade",
    b"Host",
    b"Content-Type",
    b"X-Request-Id",
    b"Content-Length ",
    b" Host",
    b"\tX-Fold",
    b"Bad Name",
    b"X\x00",
    b"X-\xc3\xa9",
    b"",
]
VALUES = [
    b"17",
    b"017",
    b"0",
    b"18446744073709551616",
    b"99999999999999999999",
    b"1_7",
    b"+17",
    b"-1",
    b"1 7",
    b"17, 17",
    b"Bearer kvi-abc",
    b"Bearer kvi-abc  ",
    b"  Bearer kvi-abc",
    b"keep-alive",
    b"Keep-Alive",
    b"close",
    b"CLOSE",
    b"upgrade",
    b"keep-alive, close",
    b"Upgrade, HTTP2-Settings",
    b"chunked",
    b"100-continue",
    b"127.0.0.1:8000",
    b"application/json",
    b"",
    b"a\tb",
    b"a\x00b",
    b"a\x7fb",
    b"caf\xc3\xa9",
    b"a\nContent-Length: 5",
    b"a\rb",
]
SEPARATORS = [b":", b": ", b":  ", b":\t", b" :", b"\t:"]


GOOD_HEADERS = [
    b"Host: 127.0.0.1:8000",
    b"Content-Type: application/json",
    b"Accept: */*",
    b"Authorization: Bearer kvi-abc",
    b"Connection: keep-alive",
    b"Connection: close",
    b"User-Agent: router/1.0",
    b"X-Empty:",
]


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """Plain score heads, most with one or two things changed from what a client sends."""
    valid = draw(st.integers(0, 3)) > 0  # three in four start from a request line the fast path takes
    if valid:
        method, gap, version = b"POST", b" ", b"HTTP/1.1"
        target = draw(st.sampled_from([b"/v1/score", b"/v1/score?model=m", b"/v1/score?"]))
    else:
        method = draw(st.sampled_from([b"POST", b"GET", b"post", b"PUT"]))
        gap = draw(st.sampled_from([b" ", b"  ", b"\t"]))
        target = draw(st.sampled_from(TARGETS) | st.binary(max_size=12).map(lambda b: b"/v1/score" + b))
        version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1"]))
    lines = [method + gap + target + b" " + version]
    if draw(st.integers(0, 7)) > 0:  # most carry one good Content-Length somewhere
        lines.append(b"Content-Length: " + draw(st.sampled_from([b"17", b"0", b"5000", b"017"])))
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 2)) > 0:
            line = draw(st.sampled_from(GOOD_HEADERS))
        else:
            name = draw(st.sampled_from(NAMES) | st.binary(max_size=6))
            value = draw(st.sampled_from(VALUES) | st.binary(max_size=8))
            line = name + draw(st.sampled_from(SEPARATORS)) + value
        lines.insert(draw(st.integers(1, len(lines))), line)
    newline = draw(st.sampled_from([b"\r\n"] * 9 + [b"\n"]))
    return newline.join(lines) + b"\r\n\r\n"


def declined_on_purpose(head: bytes) -> bool:
    """Whether a head llhttp calls plain has one of the oddities parse_head leaves to aiohttp (declining is
    always safe, but the fast path should not decline more than it says)."""
    request_line, *lines = head[:-4].split(b"\r\n")
    method, target, version = (request_line.split(b" ") + [b"", b""])[:3]
    names = [line.partition(b":")[0] for line in lines]
    read = [line for line, name in zip(lines, names, strict=True) if name.strip().lower() in READ_HEADERS]
    return (
        # a request line not exactly `POST target HTTP/1.1`, single spaces, the target visible ASCII
        request_line.count(b" ") != 2
        or (method, version) != (b"POST", b"HTTP/1.1")
        or any(byte < 0x21 or byte > 0x7E for byte in target)
        or any(b"\n" in line or b"\r" in line for line in lines)  # a bare LF or CR
        or any(not name or name[:1] in (b" ", b"\t") or name[-1:] in (b" ", b"\t") for name in names)
        or any(line.endswith((b" ", b"\t")) for line in read)  # trailing whitespace in a value it reads
        or any(byte >= 0x80 or (byte < 0x20 and byte != 9) or byte == 0x7F for byte in b"".join(lines))
        or any(name.lower() == b"connection" for name in names)  # one it does not take: upgrade, lists
    )


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=heads())
def test_a_head_it_takes_llhttp_reads_the_same(head: bytes) -> None:
    taken = reading(head)
    if taken is not None:
        assert llhttp_reading(head) == taken
    elif llhttp_reading(head) is not None:
        assert declined_on_purpose(head), head


PLAIN_HEADS = [
    b"POST /v1/score HTTP/1.1\r\nHost: h\r\nContent-Length: 17\r\n\r\n",
    b"POST /v1/score?model=m HTTP/1.1\r\ncontent-length:17\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nContent-Length: 17\r\nConnection: close\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nContent-Length: 17\r\nConnection: Keep-Alive\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nAuthorization: Bearer kvi-abc\r\nContent-Length: 0\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nAuthorization:\tBearer kvi-abc\r\nContent-Length: 017\r\nX-Empty:\r\nX: a \r\n\r\n",
]


@pytest.mark.parametrize("head", PLAIN_HEADS)
def test_plain_heads_are_taken(head: bytes) -> None:
    assert reading(head) is not None
    assert reading(head) == llhttp_reading(head)


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/score HTTP/1.1\r\nHost: h\r\n\r\n",  # no Content-Length
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length : 1\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\n folded\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\nConnection: upgrade\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\nX: a\nContent-Length: 5\r\n\r\n",
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\n",  # not a whole head
        b"POST /v1/score HTTP/1.1\r\nContent-Length: 1\r\nAuthorization: Bearer k \r\n\r\n",
    ],
)
def test_ambiguous_or_other_heads_are_left_to_aiohttp(head: bytes) -> None:
    assert parse_head(head) is None


class HeadCatcher:
    """A 127.0.0.1 server that keeps the head of each request it gets and answers 204."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.heads: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with connection:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                self.heads.append(head + b"\r\n\r\n")
                connection.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def catcher() -> Iterator[HeadCatcher]:
    server = HeadCatcher()
    yield server
    server.close()


def test_the_heads_real_clients_send_are_taken(catcher: HeadCatcher) -> None:
    url = f"http://127.0.0.1:{catcher.port}/v1/score"
    body = b'{"model":"m","token_ids":[1,2,3]}'
    headers = {"Content-Type": "application/json", "Authorization": "Bearer kvi-abc"}
    urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10).close()
    connection = HTTPConnection("127.0.0.1", catcher.port, timeout=10)
    connection.request("POST", "/v1/score?model=m", body=body, headers=headers)
    connection.getresponse().read()
    connection.close()

    async def with_aiohttp() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
            async with session.post(url, json={"model": "m", "token_ids": [1, 2, 3]}) as response:
                await response.read()

    asyncio.run(with_aiohttp())
    assert len(catcher.heads) == 4
    for head in catcher.heads:
        assert reading(head) is not None, head
        assert reading(head) == llhttp_reading(head), head
