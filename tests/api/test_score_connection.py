"""The score fast path (api/score_connection.py, api/site.py) against real servers fed by real engine streams:
plain scores answered by it with aiohttp's answers, however the bytes are split or pipelined; every other
request handed to aiohttp from its first byte, the connection staying aiohttp's; answers counted and timed;
idle and remaining connections closed. A response's `Server: kvindex` says the fast path wrote it."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from api_harness import HttpAnswer, ServerThread, reference_scores, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.settings import ApiKey, ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.status import STATE_LIVE, STATE_REPLAYING, STATE_RESYNCING, STATE_SILENT
from prometheus_client.parser import text_string_to_metric_families

MODELS = [
    ModelConfig(name="m", block_size=16, hash_seed="0", lora_adapters={"sql-lora": "/adapters/sql-lora"}),
    ModelConfig(name="m2", block_size=16, hash_seed="0"),
]
BODY_LIMIT = 64 * 1024
EXECUTOR_MIN_TOKENS = 512  # prompts this long are hashed on the worker thread: aiohttp answers them
TOKENS = list(range(1000, 1000 + 8 * 16))
KEYS = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(TOKENS)
KEY = "kvi-fast-7d1e"
WEIGHTS = {"GPU": 1.0, "CPU": 0.8}
# What a stream with every block in the index may be in while the tests run.
POD_STATES = (STATE_LIVE, STATE_REPLAYING, STATE_RESYNCING, STATE_SILENT)


def settings(**overrides: Any) -> ApiSettings:
    return ApiSettings(
        host="127.0.0.1",
        port=0,
        max_body_bytes=BODY_LIMIT,
        hash_in_executor_min_tokens=EXECUTOR_MIN_TOKENS,
        **overrides,
    )


class Fleet:
    def __init__(self, service: IngestService, engines: list[Engine]) -> None:
        self.service = service
        self.engines = engines

    def expected(self, block_keys: Sequence[int], pods: Sequence[str] | None = None) -> list[dict[str, Any]]:
        return reference_scores(
            self.engines, block_keys, block_size=16, tier_weights=WEIGHTS, unknown_tier_weight=0.0, pods=pods
        )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    engines = [Engine("pod-a", model="m"), Engine("pod-b", model="m")]
    service = start_service(MODELS, engines)
    try:
        engines[0].store(KEYS, TOKENS, block_size=16)
        engines[1].store(KEYS[:3], TOKENS[:48], block_size=16, tier="CPU")
        wait_until_ingested(service, engines)
        yield Fleet(service, engines)
    finally:
        service.stop()
        for engine in engines:
            engine.close()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def fast(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """On each loop `kvindex serve` may run: their transports differ (uvloop's are not asyncio's classes)."""
    server = ServerThread(fleet.service, settings(), event_loop=request.param).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow(fleet: Fleet) -> Iterator[ServerThread]:
    """The same app with every request answered by aiohttp: the answers the fast path must give."""
    server = ServerThread(fleet.service, settings(), fast_score=False).start()
    yield server
    server.stop()


class Answer(HttpAnswer):
    """Headers with lower-case names."""

    @property
    def fast(self) -> bool:
        return self.headers.get("server") == "kvindex"

    def scores(self) -> list[dict[str, Any]]:
        """The answer's scores less each stream's health, which changes with time (the last event's age;
        None until a live event is heard, when the first batches came by replay)."""
        entries = self.json()["scores"]
        for entry in entries:
            if "last_event_age_s" in entry:
                age = entry.pop("last_event_age_s")
                assert age is None or age >= 0
                assert entry.pop("state") in POD_STATES
        return list(entries)

    def steady(self) -> dict[str, Any]:
        return {**self.json(), "scores": self.scores()}


class RawConnection:
    """One TCP connection sending bytes exactly as given and reading HTTP/1.1 answers one by one."""

    def __init__(self, url: str) -> None:
        target = urllib.parse.urlsplit(url)
        assert target.hostname is not None and target.port is not None
        self.sock = socket.create_connection((target.hostname, target.port), timeout=15)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = self.sock.makefile("rb")

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._reader.close()
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> Answer:
        status_line = self._reader.readline()
        assert status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), status_line
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status < 200:
            body = b""
        elif "content-length" in headers:
            body = self._reader.read(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._reader.readline().strip(), 16):
                body += self._reader.read(size)
                self._reader.readline()
            self._reader.readline()
        else:  # until the server closes
            body = self._reader.read()
        return Answer(status, headers, body)

    def exchange(self, data: bytes) -> Answer:
        self.send(data)
        return self.answer()

    def closed_by_server(self, timeout_s: float = 5.0) -> bool:
        self.sock.settimeout(timeout_s)
        try:
            return self._reader.read(1) == b""
        except (TimeoutError, ConnectionResetError):
            return False


def request(
    body: bytes,
    *,
    method: str = "POST",
    target: str = "/v1/score",
    version: str = "1.1",
    headers: Sequence[str] = (),
    content_length: bool = True,
) -> bytes:
    lines = [f"{method} {target} HTTP/{version}", "Host: 127.0.0.1", "Content-Type: application/json"]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    lines.extend(headers)
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def score(value: dict[str, Any]) -> bytes:
    return request(json.dumps(value).encode())


def once(server: ServerThread, data: bytes) -> Answer:
    with RawConnection(server.url) as connection:
        return connection.exchange(data)


GOOD = {
    "tokens": {"model": "m", "token_ids": TOKENS},
    "tokens, a partial last block": {"model": "m", "token_ids": TOKENS + [7, 8, 9]},
    "block hashes": {"model": "m", "block_hashes": KEYS},
    "a prefix of the hashes": {"model": "m", "block_hashes": KEYS[:2]},
    "pods, one unknown": {"model": "m", "token_ids": TOKENS, "pods": ["pod-b", "pod-x"]},
    "compact, by score": {"model": "m", "block_hashes": KEYS, "answer": "compact", "rank": "score"},
    "nothing held": {"model": "m", "block_hashes": [1, 2, 3]},
    "the only other model, by name": {"model": "m2", "token_ids": TOKENS},
}


@pytest.mark.parametrize("name", list(GOOD))
def test_plain_scores_take_the_fast_path_with_aiohttps_answers(
    fleet: Fleet, fast: ServerThread, slow: ServerThread, name: str
) -> None:
    value = GOOD[name]
    ours, theirs = once(fast, score(value)), once(slow, score(value))
    assert ours.fast and not theirs.fast
    assert ours.status == theirs.status == 200, ours.body
    assert ours.steady() == theirs.steady()
    assert ours.headers["content-type"] == theirs.headers["content-type"] == "application/json"
    assert ours.headers["date"].endswith(" GMT")
    if value.get("answer") != "compact":
        keys = value.get("block_hashes") or KEYS
        expected = fleet.expected(keys, value.get("pods")) if value["model"] == "m" else []
        assert ours.scores() == expected


MISTAKES = {
    "malformed json": b'{"model": "m", "token_ids": [1, 2',
    "an empty body": b"",
    "a token id that is a string": json.dumps({"model": "m", "token_ids": [1, "2"]}).encode(),
    "a negative block hash": json.dumps({"model": "m", "block_hashes": [-1]}).encode(),
    "a block hash of 2**64": json.dumps({"model": "m", "block_hashes": [1, 2**64]}).encode(),
    "an unknown model": json.dumps({"model": "gpt-9", "token_ids": [1]}).encode(),
    "no model with two configured": json.dumps({"token_ids": [1]}).encode(),
    "an unknown adapter": json.dumps({"model": "m", "token_ids": [1], "lora_name": "nope"}).encode(),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_client_mistakes_get_aiohttps_errors_from_the_fast_path(
    fast: ServerThread, slow: ServerThread, name: str
) -> None:
    ours, theirs = once(fast, request(MISTAKES[name])), once(slow, request(MISTAKES[name]))
    assert ours.fast and not theirs.fast
    assert ours.status == theirs.status and ours.status in (400, 404)
    assert ours.json() == theirs.json()
    assert set(ours.json()) == {"error"}


def test_a_connection_goes_on_after_a_mistake(fast: ServerThread) -> None:
    with RawConnection(fast.url) as connection:
        assert connection.exchange(request(b"{")).status == 400
        answer = connection.exchange(score(GOOD["tokens"]))
        assert answer.fast and answer.status == 200


@pytest.mark.parametrize("pieces", ["each byte", "inside the prefix", "at the blank line", "inside the body"])
def test_a_request_split_anywhere_gets_the_same_answer(fleet: Fleet, fast: ServerThread, pieces: str) -> None:
    data = score(GOOD["tokens"])
    head_end = data.index(b"\r\n\r\n") + 4
    cuts = {
        "each byte": list(range(1, len(data))),
        "inside the prefix": [1, 6, 13, 14, 15],
        "at the blank line": [head_end - 3, head_end - 1, head_end],
        "inside the body": [head_end + 1, head_end + 40, len(data) - 1],
    }[pieces]
    with RawConnection(fast.url) as connection:
        for _ in range(2):  # the second on the same connection: nothing of the first is left behind
            previous = 0
            for cut in [*cuts, len(data)]:
                connection.send(data[previous:cut])
                previous = cut
                time.sleep(0.0005 if pieces == "each byte" else 0.02)  # ok: pieces must arrive apart
            answer = connection.answer()
            assert answer.fast and answer.status == 200
            assert answer.scores() == fleet.expected(KEYS)


def test_pipelined_requests_are_answered_in_order_and_aiohttp_keeps_the_connection(
    fleet: Fleet, fast: ServerThread
) -> None:
    pipelined = [
        score(GOOD["tokens"]),
        score(GOOD["a prefix of the hashes"]),
        request(b"", method="GET", target="/healthz", content_length=False),
        score(GOOD["tokens"]),
    ]
    with RawConnection(fast.url) as connection:
        connection.send(b"".join(pipelined))
        answers = [connection.answer() for _ in pipelined]
    assert [a.status for a in answers] == [200, 200, 200, 200]
    assert [a.fast for a in answers] == [True, True, False, False]
    assert answers[0].scores() == answers[3].scores() == fleet.expected(KEYS)
    assert answers[1].scores() == fleet.expected(KEYS[:2])
    assert answers[2].json() == {"status": "ok"}


def test_connection_close_is_honoured(fast: ServerThread) -> None:
    with RawConnection(fast.url) as connection:
        connection.send(request(json.dumps(GOOD["block hashes"]).encode(), headers=["Connection: close"]))
        answer = connection.answer()
        assert answer.fast and answer.status == 200
        assert answer.headers["connection"] == "close"
        assert connection.closed_by_server()


LONG_PROMPT = list(range(EXECUTOR_MIN_TOKENS + 16))
CHUNKED_BODY = json.dumps(GOOD["tokens"]).encode()
# (id, the request, its status, a check of the answer's JSON)
LEFT_TO_AIOHTTP: list[tuple[str, bytes, int, Any]] = [
    (
        "a chunked body",
        request(
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHUNKED_BODY), CHUNKED_BODY),
            headers=["Transfer-Encoding: chunked"],
            content_length=False,
        ),
        200,
        "scores",
    ),
    ("HTTP/1.0", request(json.dumps(GOOD["tokens"]).encode(), version="1.0"), 200, "scores"),
    ("a body over the limit", request(b" " * (BODY_LIMIT + 1)), 413, "body: larger than the limit"),
    (
        "a prompt hashed on the worker thread",
        score({"model": "m", "token_ids": LONG_PROMPT}),
        200,
        "scores",
    ),
    ("a bad Content-Length", request(b"{}", content_length=False, headers=["Content-Length: 2x"]), 400, None),
    (
        "two Content-Lengths",
        request(b"{}", content_length=False, headers=["Content-Length: 2", "Content-Length: 2"]),
        400,
        None,
    ),
    ("GET /v1/score", request(b"", method="GET", content_length=False), 405, "method: GET"),
    ("/v1/scores", request(b"{}", target="/v1/scores"), 404, "path: no route /v1/scores"),
    ("a head over 16 KiB", request(b"{}", headers=["X-Pad: " + "p" * 17_000]), 400, None),
]


@pytest.mark.parametrize(
    ("data", "status", "check"), [row[1:] for row in LEFT_TO_AIOHTTP], ids=[row[0] for row in LEFT_TO_AIOHTTP]
)
def test_other_requests_are_answered_by_aiohttp(
    fleet: Fleet, fast: ServerThread, data: bytes, status: int, check: str | None
) -> None:
    with RawConnection(fast.url) as connection:
        answer = connection.exchange(data)
        assert not answer.fast
        assert answer.status == status, answer.body
        if check == "scores":
            scores = answer.scores()
            assert scores == fleet.expected(KEYS) if b"1000, 1001" in data else scores == []
        elif check is not None:
            assert answer.json()["error"].startswith(check)
        if status < 400 and b" HTTP/1.1\r\n" in data:  # the connection is aiohttp's from then on, and serves
            again = connection.exchange(score(GOOD["block hashes"]))
            assert not again.fast and again.scores() == fleet.expected(KEYS)


def test_expect_100_continue_is_aiohttps(fleet: Fleet, fast: ServerThread) -> None:
    body = json.dumps(GOOD["block hashes"]).encode()
    with RawConnection(fast.url) as connection:
        data = request(body, headers=["Expect: 100-continue"])
        connection.send(data[: -len(body)])
        interim = connection.answer()
        assert interim.status == 100 and not interim.fast
        connection.send(body)
        answer = connection.answer()
    assert answer.status == 200 and not answer.fast
    assert answer.scores() == fleet.expected(KEYS)


def test_a_query_string_stays_on_the_fast_path(fleet: Fleet, fast: ServerThread) -> None:
    answer = once(fast, request(json.dumps(GOOD["tokens"]).encode(), target="/v1/score?trace=1"))
    assert answer.fast and answer.scores() == fleet.expected(KEYS)


def request_counts(server: ServerThread) -> dict[tuple[str, str], float]:
    """kvindex_http_requests_total of /v1/score by status, and the score latency histogram's count."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvindex_http_requests_total" and sample.labels["route"] == "/v1/score":
                counts[("requests", sample.labels["status"])] = sample.value
            elif sample.name == "kvindex_score_latency_seconds_count":
                counts[("timed", "")] = sample.value
    return counts


def test_fast_answers_are_counted_and_timed(fast: ServerThread) -> None:
    before = request_counts(fast)
    with RawConnection(fast.url) as connection:
        for _ in range(5):
            assert connection.exchange(score(GOOD["tokens"])).fast
        assert connection.exchange(request(b"[")).status == 400
    after = request_counts(fast)
    assert after[("requests", "200")] == before.get(("requests", "200"), 0.0) + 5
    assert after[("requests", "400")] == before.get(("requests", "400"), 0.0) + 1
    assert after[("timed", "")] == before.get(("timed", ""), 0.0) + 5


def test_a_client_that_does_not_read_its_answers_gets_them_all(fleet: Fleet, fast: ServerThread) -> None:
    # Far more answers than the transport buffers: the server stops reading until the client reads.
    num_requests = 3000
    data = score(GOOD["block hashes"]) * num_requests
    with RawConnection(fast.url) as connection:
        sender = threading.Thread(target=connection.send, args=(data,))
        sender.start()
        time.sleep(0.5)  # ok: unread answers pile up until the server stops reading
        answers = [connection.answer() for _ in range(num_requests)]
        sender.join(15)
    assert all(a.status == 200 and a.fast for a in answers)
    assert answers[-1].scores() == fleet.expected(KEYS)


@pytest.fixture(scope="module")
def keyed(fleet: Fleet) -> Iterator[ServerThread]:
    server = ServerThread(fleet.service, settings(api_key=ApiKey(KEY))).start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("authorization", "status", "fast"),
    [
        ([f"Authorization: Bearer {KEY}"], 200, True),
        ([f"Authorization: bearer   {KEY}"], 200, True),
        ([], 401, False),
        (["Authorization: Bearer wrong"], 401, False),
        ([f"Authorization: Bearer {KEY}", f"Authorization: Bearer {KEY}"], 200, False),
    ],
    ids=["the key", "the key, spaced", "no header", "a wrong key", "the key twice"],
)
def test_with_an_api_key_only_authorised_scores_take_the_fast_path(
    keyed: ServerThread, authorization: list[str], status: int, fast: bool
) -> None:
    answer = once(keyed, request(json.dumps(GOOD["block hashes"]).encode(), headers=authorization))
    assert (answer.status, answer.fast) == (status, fast), answer.body
    if status == 401:
        assert answer.headers["www-authenticate"].startswith("Bearer")


def test_idle_fast_connections_are_closed(fleet: Fleet) -> None:
    server = ServerThread(
        fleet.service, settings(), event_loop="uvloop", keepalive_timeout_s=0.5, sweep_interval_s=0.1
    ).start()
    try:
        with RawConnection(server.url) as busy, RawConnection(server.url) as idle:
            assert idle.exchange(score(GOOD["block hashes"])).fast
            for _ in range(15):  # 1.5 s of requests 0.1 s apart: never idle for 0.5 s, so never closed
                assert busy.exchange(score(GOOD["block hashes"])).fast
                time.sleep(0.1)  # ok: the pace that keeps `busy` under the idle timeout
            assert idle.closed_by_server(timeout_s=1.0)
        with RawConnection(server.url) as idle:
            assert idle.exchange(score(GOOD["block hashes"])).fast
            started = time.monotonic()
            assert idle.closed_by_server(timeout_s=5.0)
            assert 0.4 < time.monotonic() - started < 3.0
    finally:
        server.stop()


def test_stopping_the_server_closes_its_fast_connections(fleet: Fleet) -> None:
    server = ServerThread(fleet.service, settings(), event_loop="uvloop").start()
    try:
        with RawConnection(server.url) as connection:
            assert connection.exchange(score(GOOD["block hashes"])).fast
            started = time.monotonic()
            server.stop()
            assert time.monotonic() - started < 5.0
            assert connection.closed_by_server()
    finally:
        server.stop()
