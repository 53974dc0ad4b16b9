"""`POST /v1/score` without aiohttp's per-request machinery: the protocol every API connection starts with.

aiohttp builds a task, a request, a payload stream and a response writer per request: on two cores that is
~0.15 ms of a score's median and ~1 ms of its p99 (a handler that answers a constant: 0.33 vs 0.19 ms
p50, 1.4 vs 0.4 ms p99, against this protocol). A router keeps its connection open and sends nothing but
scores on it, so each connection starts here. This protocol frames requests itself (the head up to the
first CRLFCRLF, then Content-Length bytes of body), parses the head itself (parse_head: a narrow, strict
shape), and answers a plain score on the event loop with ScoreHandler.answer_now: POST /v1/score,
HTTP/1.1, one Content-Length within the body limit, no Transfer-Encoding, Expect or Upgrade, and the API
key when one is set.

Anything else is handed to aiohttp's own protocol from the first byte of that request on, and aiohttp keeps
the connection from then on: other routes, chunked bodies, 100-continue, 401s, 413s, malformed heads,
prompts hashed on the worker thread and remote stores are all answered exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

from kvindex.api.auth import authorization_problem
from kvindex.api.failures import INTERNAL_ERROR, expected_failure
from kvindex.api.schemas import JSON_ENCODER, ErrorBody
from kvindex.api.score import ScoreHandler
from kvindex.api.settings import ApiKey

logger = logging.getLogger(__name__)

SCORE_PATH = b"/v1/score"
ROUTE = "/v1/score"  # the route label of kvindex_http_requests, as aiohttp's router names it
_REQUEST_PREFIX = b"POST " + SCORE_PATH
# A head longer than this goes to aiohttp, which applies its own limits (8190 bytes a line) and answers.
MAX_HEAD_BYTES = 16 * 1024
_HEAD_END = b"\r\n\r\n"
_NOT_PLAIN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_READ = frozenset({b"content-length", b"authorization", b"connection"})  # the headers parse_head reads
# The bytes a head may hold where parse_head takes it: RFC 9110's token characters in a header's name,
# visible ASCII in the request target, and visible ASCII, space and tab in a header's value.
_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_URL_BYTES = bytes(range(0x21, 0x7F))
_VALUE_BYTES = bytes(range(0x20, 0x7F)) + b"\t"
# aiohttp's headers for a JSON body, less its Server (which names Python's and aiohttp's versions).
_RESPONSE_HEAD = (
    b"HTTP/1.1 %d %s\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: %d\r\n"
    b"Date: %s\r\n"
    b"Server: kvindex\r\n"
    b"%s\r\n"
)
_REASONS = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}


class RequestHead:
    """What the fast path needs of one request head."""

    __slots__ = ("url", "content_length", "authorization", "keep_alive")

    def __init__(
        self, url: bytes, content_length: int, authorization: bytes | None, keep_alive: bool
    ) -> None:
        self.url = url
        self.content_length = content_length
        self.authorization = authorization
        self.keep_alive = keep_alive


def parse_head(head: bytes) -> RequestHead | None:
    """The head (request line to the blank line, inclusive) of a plain `POST /v1/score` over HTTP/1.1 with
    one Content-Length; None for any other head, well-formed or not, which aiohttp then parses and answers.

    Only a narrow, unambiguous shape is taken: the request line exactly `POST /v1/score[?query] HTTP/1.1`
    (visible ASCII), every header `token:value` with the value in visible ASCII, spaces and tabs (no
    space before the colon, no folded line, no bare CR or LF, no other byte), Content-Length digits once,
    Authorization at most once, Connection `keep-alive` or `close` at most once (these three without
    trailing whitespace), and no Transfer-Encoding, Expect or Upgrade. A head it takes, llhttp (httptools,
    aiohttp's parser) reads the same (tests/api/test_request_head.py). It replaces httptools' parser, whose per-header callbacks into
    Python cost ~39 us of an answer after the event loop's thread wakes from idle, against ~19 us here
    (the median of 1,500 alternated calls after 1 ms sleeps; ~2 us each when warm)."""
    if not head.endswith(_HEAD_END):
        return None
    lines = head.split(b"\r\n")
    request_line = lines[0]
    if not request_line.startswith(_REQUEST_PREFIX) or not request_line.endswith(b" HTTP/1.1"):
        return None
    url = request_line[5:-9]
    if (url != SCORE_PATH and not url.startswith(b"?", len(SCORE_PATH))) or url.translate(None, _URL_BYTES):
        return None
    content_length: int | None = None
    authorization: bytes | None = None
    connection: bytes | None = None
    for line in lines[1:-2]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TOKEN_BYTES):
            return None
        value = value.lstrip(b" \t")
        if value.translate(None, _VALUE_BYTES):
            return None
        name = name.lower()
        if name in _READ and value.endswith((b" ", b"\t")):
            return None  # llhttp keeps a value's trailing whitespace, aiohttp drops it: leave it to aiohttp
        if name == b"content-length":
            if content_length is not None or not value.isdigit() or len(value) > 18:
                return None
            content_length = int(value)
        elif name == b"authorization":
            if authorization is not None:
                return None
            authorization = value
        elif name == b"connection":
            if connection is not None:
                return None
            connection = value.lower()
            if connection != b"keep-alive" and connection != b"close":
                return None
        elif name in _NOT_PLAIN:
            return None
    if content_length is None:
        return None
    return RequestHead(url, content_length, authorization, connection != b"close")


class FastScore:
    """What every fast connection of one app shares: the score handler, the limits it checks, the request
    counter, and the cached Date header."""

    def __init__(
        self,
        handler: ScoreHandler,
        max_body_bytes: int,
        api_key: ApiKey | None,
        count: Callable[[str, int], None],
    ) -> None:
        self._handler = handler
        self._max_body_bytes = max_body_bytes
        self._api_key = api_key
        self._count = count
        self._date_second = -1
        self._date = b""
        # The last answer's bookkeeping, done by after_write once it is written: (status, when it began or
        # None for an error, its best match).
        self._unrecorded: tuple[int, float | None, int] | None = None

    def accepts(self, head: RequestHead) -> bool:
        """Whether the fast path answers this head (else aiohttp does, with its 413 or 401)."""
        assert head.content_length is not None
        if head.content_length > self._max_body_bytes:
            return False
        if self._api_key is None:
            return True
        if head.authorization is None:
            return False
        # as aiohttp decodes header bytes, so a key compares the same on both paths
        header = head.authorization.decode("utf-8", "surrogateescape")
        return authorization_problem(header, self._api_key) is None

    def respond(self, body: bytes, keep_alive: bool) -> bytes | None:
        """The whole HTTP response to a score request's body; None when aiohttp must answer it (it needs a
        thread: see ScoreHandler.answer_now). Call after_write once the response is written."""
        try:
            answered = self._handler.answer_now(body)
        except Exception as exc:
            failure = expected_failure(exc)
            if failure is None:
                logger.exception("unhandled error answering POST %s", ROUTE)
                failure = (500, INTERNAL_ERROR)
            status, message = failure
            answer = JSON_ENCODER.encode(ErrorBody(error=message))
            self._unrecorded = (status, None, 0)
        else:
            if answered is None:
                return None
            answer, started, best = answered
            status = 200
            self._unrecorded = (status, started, best)
        return self._head(status, len(answer), keep_alive) + answer

    def after_write(self) -> None:
        """The bookkeeping of the response `respond` last made, done after it is written so the client
        does not wait for it: its metrics (prometheus_client's locks and buckets: ~3 us of a hot answer,
        more of a cold one) and the hasher memo's record of its prompt (ScoreHandler.after_answer)."""
        unrecorded = self._unrecorded
        if unrecorded is None:
            return
        self._unrecorded = None
        status, started, best = unrecorded
        self._count(ROUTE, status)
        self._handler.after_answer(started, best)

    def _head(self, status: int, length: int, keep_alive: bool) -> bytes:
        second = int(time.time())
        if second != self._date_second:
            self._date_second = second
            self._date = formatdate(second, usegmt=True).encode("ascii")
        return _RESPONSE_HEAD % (
            status,
            _REASONS[status],
            length,
            self._date,
            b"" if keep_alive else b"Connection: close\r\n",
        )


class ScoreConnection(asyncio.Protocol):
    """One client connection, until it closes or a request makes it aiohttp's (`fallback` builds that
    protocol). `connections` holds the live ones, so the listener can close them and sweep idle ones."""

    def __init__(
        self,
        fast: FastScore,
        fallback: Callable[[], asyncio.Protocol],
        connections: set[ScoreConnection],
    ) -> None:
        self._fast = fast
        self._fallback = fallback
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        # The bytes of the current request received so far (its first byte first), and how many there are.
        self._chunks: list[bytes] = []
        self._buffered = 0
        # How many bytes the current request must reach before it is worth looking at again.
        self._needed = 1
        self._head: RequestHead | None = None
        self._body_start = 0
        self._reading_paused = False
        self.last_active = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always a subclass of asyncio.Transport (uvloop's are not).
        self._transport = cast(asyncio.Transport, transport)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._chunks.clear()

    def pause_writing(self) -> None:
        # A client that sends requests without reading the answers: stop reading until it catches up.
        if self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True

    def resume_writing(self) -> None:
        if self._transport is not None and self._reading_paused:
            self._transport.resume_reading()
            self._reading_paused = False

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered < self._needed:
            return
        buffer = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._serve(buffer)

    def _serve(self, buffer: bytes) -> None:
        """Answer every complete request in `buffer` (which starts at a request's first byte), keep the
        incomplete rest, or hand the rest to aiohttp at the first request the fast path does not answer."""
        transport = self._transport
        assert transport is not None
        start = 0
        while start < len(buffer):
            head = self._head
            if head is None:
                pending = len(buffer) - start
                if not buffer.startswith(_REQUEST_PREFIX[:pending], start):
                    return self._hand_off(buffer, start)
                head_end = buffer.find(_HEAD_END, start, start + MAX_HEAD_BYTES)
                if head_end < 0:
                    if pending >= MAX_HEAD_BYTES:
                        return self._hand_off(buffer, start)
                    return self._keep(buffer, start, pending + 1)
                head = parse_head(buffer[start : head_end + len(_HEAD_END)])
                if head is None or not self._fast.accepts(head):
                    return self._hand_off(buffer, start)
                self._head = head
                self._body_start = head_end + len(_HEAD_END) - start
            assert head.content_length is not None
            end = start + self._body_start + head.content_length
            if end > len(buffer):
                return self._keep(buffer, start, end - start)
            response = self._fast.respond(buffer[start + self._body_start : end], head.keep_alive)
            if response is None:
                return self._hand_off(buffer, start)
            self._head = None
            transport.write(response)
            self._fast.after_write()
            if not head.keep_alive:
                transport.close()
                return None
            start = end
        self._needed = 1
        return None

    def _keep(self, buffer: bytes, start: int, needed: int) -> None:
        rest = buffer[start:] if start else buffer
        self._chunks.append(rest)
        self._buffered = len(rest)
        self._needed = needed

    def _hand_off(self, buffer: bytes, start: int) -> None:
        """Make the connection aiohttp's, from the request starting at `buffer[start]` on."""
        transport = self._transport
        assert transport is not None
        self._connections.discard(self)
        self._transport = None
        self._head = None
        if self._reading_paused:
            # aiohttp's protocol does not know reading was paused, and would never resume it.
            transport.resume_reading()
        protocol = self._fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(buffer[start:] if start else buffer)
