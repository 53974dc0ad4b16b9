"""Nothing a client sends breaks the server: a table of bad requests -> 4xx naming the field, then a
good request still scores (against a real server fed by a real engine stream)."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
from api_harness import ServerThread, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.settings import ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig

BODY_LIMIT = 1024 * 1024
TOKEN_LIMIT = 100_000
MODELS = [
    ModelConfig(name="m", block_size=16, hash_seed="0", lora_adapters={"sql-lora": "/adapters/sql-lora"}),
    ModelConfig(name="m2", block_size=16, hash_seed="0"),
]
GOOD_TOKENS = list(range(100, 100 + 64))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[IngestService, ServerThread, Engine]]:
    engine = Engine("pod-a", model="m")
    idle = Engine("pod-idle", model="m")  # a stream that never stores a block
    service = start_service(MODELS, [engine, idle])
    settings = ApiSettings(host="127.0.0.1", port=0, max_body_bytes=BODY_LIMIT, max_tokens=TOKEN_LIMIT)
    server = ServerThread(service, settings).start()
    try:
        keys = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(GOOD_TOKENS)
        engine.store(keys, GOOD_TOKENS, block_size=16)
        wait_until_ingested(service, [engine])
        yield service, server, engine
    finally:
        server.stop()
        service.stop()
        engine.close()
        idle.close()


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


# (id, raw body, expected status, a word the error must contain)
BAD_REQUESTS: list[tuple[str, bytes, int, str]] = [
    ("malformed json", b'{"model": "m", "token_ids": [1, 2', 400, "body"),
    ("not json at all", b"\x00\xff garbage", 400, "body"),
    ("empty body", b"", 400, "body"),
    ("array body", j([1, 2, 3]), 400, "body"),
    ("token_ids not a list", j({"model": "m", "token_ids": "1,2,3"}), 400, "token_ids"),
    ("token id a string", j({"model": "m", "token_ids": [1, "2"]}), 400, "token_ids[1]"),
    ("token id a float", j({"model": "m", "token_ids": [1.5]}), 400, "token_ids[0]"),
    ("token id a bool", j({"model": "m", "token_ids": [True]}), 400, "token_ids[0]"),
    ("token id null", j({"model": "m", "token_ids": [None]}), 400, "token_ids[0]"),
    ("negative token id", j({"model": "m", "token_ids": [5, -1]}), 400, "token_ids[1]"),
    ("token id 2**32", j({"model": "m", "token_ids": [2**32]}), 400, "token_ids[0]"),
    ("huge token id", b'{"model": "m", "token_ids": [' + b"9" * 400 + b"]}", 400, "token_ids[0]"),
    ("too many tokens", j({"model": "m", "token_ids": [1] * (TOKEN_LIMIT + 1)}), 400, "token_ids"),
    ("empty prompt", j({"model": "m", "token_ids": []}), 400, "token_ids"),
    ("neither tokens nor hashes", j({"model": "m"}), 400, "token_ids"),
    ("both tokens and hashes", j({"model": "m", "token_ids": [1], "block_hashes": [1]}), 400, "token_ids"),
    ("negative block hash", j({"model": "m", "block_hashes": [-1]}), 400, "block_hashes[0]"),
    ("block hash 2**64", j({"model": "m", "block_hashes": [7, 2**64]}), 400, "block_hashes[1]"),
    ("block hash a string", j({"model": "m", "block_hashes": ["ab"]}), 400, "block_hashes[0]"),
    ("empty block hashes", j({"model": "m", "block_hashes": []}), 400, "block_hashes"),
    ("model not a string", j({"model": 3, "token_ids": [1]}), 400, "model"),
    ("unknown model", j({"model": "gpt-9", "token_ids": [1]}), 404, "model"),
    ("model omitted with two models", j({"token_ids": [1]}), 400, "model"),
    ("unknown lora", j({"model": "m", "token_ids": [1], "lora_name": "nope"}), 400, "lora_name"),
    (
        "lora on a model without table",
        j({"model": "m2", "token_ids": [1], "lora_name": "sql-lora"}),
        400,
        "lora_name",
    ),
    ("lora_path without name", j({"model": "m", "token_ids": [1], "lora_path": "/x"}), 400, "lora_path"),
    (
        "lora with block hashes",
        j({"model": "m", "block_hashes": [1], "lora_name": "sql-lora"}),
        400,
        "lora_name",
    ),
    ("cache_salt not a string", j({"model": "m", "token_ids": [1], "cache_salt": 5}), 400, "cache_salt"),
    ("mm not a list", j({"model": "m", "token_ids": [1], "mm": {"identifier": "x"}}), 400, "mm"),
    (
        "mm item missing offset",
        j({"model": "m", "token_ids": [1], "mm": [{"identifier": "x", "length": 1}]}),
        400,
        "mm[0]",
    ),
    (
        "mm unknown key",
        j(
            {
                "model": "m",
                "token_ids": [1] * 4,
                "mm": [{"identifier": "x", "offset": 0, "length": 1, "colour": 1}],
            }
        ),
        400,
        "mm[0].colour: unknown field",
    ),
    (
        "mm negative offset",
        j({"model": "m", "token_ids": [1] * 4, "mm": [{"identifier": "x", "offset": -1, "length": 1}]}),
        400,
        "mm[0].offset",
    ),
    (
        "mm zero length",
        j({"model": "m", "token_ids": [1] * 4, "mm": [{"identifier": "x", "offset": 0, "length": 0}]}),
        400,
        "mm[0].length",
    ),
    (
        "mm past the prompt",
        j({"model": "m", "token_ids": [1] * 4, "mm": [{"identifier": "x", "offset": 2, "length": 3}]}),
        400,
        "mm[0]",
    ),
    (
        "mm empty identifier",
        j({"model": "m", "token_ids": [1] * 4, "mm": [{"identifier": "", "offset": 0, "length": 1}]}),
        400,
        "mm[0].identifier",
    ),
    # Unknown fields: a router with a typo, or one sending text, must hear it was not understood.
    (
        "unknown extra key",
        j({"model": "m", "token_ids": GOOD_TOKENS, "priority": 3}),
        400,
        "priority: unknown field",
    ),
    (
        "misspelt token_ids",
        j({"model": "m", "token_id": [1]}),
        400,
        "token_id: unknown field; did you mean token_ids?",
    ),
    (
        "text prompt",
        j({"model": "m", "prompt": "You are a helpful assistant."}),
        400,
        "prompt: text is not accepted; send token_ids (tokenize with the model's tokenizer) or block_hashes",
    ),
    (
        "mm misspelt key",
        j({"model": "m", "token_ids": [1], "mm": [{"identifer": "x"}]}),
        400,
        "mm[0].identifer",
    ),
    ("pods not a list", j({"model": "m", "token_ids": [1], "pods": "pod-a"}), 400, "pods"),
    ("pods empty", j({"model": "m", "token_ids": [1], "pods": []}), 400, "pods"),
    ("pod id not a string", j({"model": "m", "token_ids": [1], "pods": [1]}), 400, "pods[0]"),
    ("pods a list of lists", j({"model": "m", "token_ids": [1], "pods": [["pod-a"]]}), 400, "pods[0]"),
    ("pod id null", j({"model": "m", "token_ids": [1], "pods": [None]}), 400, "pods[0]"),
    # More body shapes and nesting.
    ("body a JSON string", j("token_ids"), 400, "body"),
    ("body null", b"null", 400, "body"),
    ("body a number", b"42", 400, "body"),
    ("nested token lists", j({"model": "m", "token_ids": [[1, 2], [3]]}), 400, "token_ids[0]"),
    ("nested block hashes", j({"model": "m", "block_hashes": [[1]]}), 400, "block_hashes[0]"),
    ("block hash far above 2**64", j({"model": "m", "block_hashes": [2**70]}), 400, "block_hashes[0]"),
    ("block hash below int64", j({"model": "m", "block_hashes": [-(2**63) - 1]}), 400, "block_hashes[0]"),
    # null means "not given": a required field that is null is missing.
    ("token_ids null", j({"model": "m", "token_ids": None}), 400, "token_ids"),
    ("both null", j({"model": "m", "token_ids": None, "block_hashes": None}), 400, "token_ids"),
    ("model null with two models", j({"model": None, "token_ids": [1]}), 400, "model"),
    ("mm item null", j({"model": "m", "token_ids": [1], "mm": [None]}), 400, "mm[0]"),
    ("mm identifier null", j({"model": "m", "token_ids": [1], "mm": [{"identifier": None}]}), 400, "mm[0]"),
    (
        "mm offset beyond the prompt",
        j({"model": "m", "token_ids": [1] * 4, "mm": [{"identifier": "x", "offset": 10, "length": 1}]}),
        400,
        "mm[0]",
    ),
    (
        "mm overlapping",
        j(
            {
                "model": "m",
                "token_ids": [1] * 8,
                "mm": [
                    {"identifier": "x", "offset": 0, "length": 4},
                    {"identifier": "y", "offset": 2, "length": 2},
                ],
            }
        ),
        400,
        "mm[1].offset",
    ),
    (
        "mm unsorted",
        j(
            {
                "model": "m",
                "token_ids": [1] * 8,
                "mm": [
                    {"identifier": "x", "offset": 4, "length": 2},
                    {"identifier": "y", "offset": 0, "length": 2},
                ],
            }
        ),
        400,
        "mm[1].offset",
    ),
]

# Odd but valid: each must score like a plain request (pod-a holds all 4 blocks of GOOD_TOKENS).
ODD_GOOD_REQUESTS: list[tuple[str, bytes, str | None]] = [
    ("text/plain content type", j({"model": "m", "token_ids": GOOD_TOKENS}), "text/plain"),
    ("no content type", j({"model": "m", "token_ids": GOOD_TOKENS}), None),
    ("form content type", j({"model": "m", "token_ids": GOOD_TOKENS}), "application/x-www-form-urlencoded"),
    (
        "optional fields null",
        j(
            {
                "model": "m",
                "token_ids": GOOD_TOKENS,
                "block_hashes": None,
                "lora_name": None,
                "lora_path": None,
                "cache_salt": None,
                "mm": None,
                "pods": None,
            }
        ),
        "application/json",
    ),
    ("pods naming pod-a", j({"model": "m", "token_ids": GOOD_TOKENS, "pods": ["pod-a", "gone"]}), None),
    ("whitespace around the document", b"  \n" + j({"model": "m", "token_ids": GOOD_TOKENS}) + b"\n ", None),
]


async def post_raw(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json()


def assert_good_request_scores(server: ServerThread) -> None:
    status, payload = asyncio.run(
        post_raw(server.url + "/v1/score", j({"model": "m", "token_ids": GOOD_TOKENS}))
    )
    assert status == 200, payload
    assert [(s["pod"], s["matched_blocks"]) for s in payload["scores"]] == [("pod-a", 4)]


@pytest.mark.parametrize(
    ("body", "status", "word"), [row[1:] for row in BAD_REQUESTS], ids=[row[0] for row in BAD_REQUESTS]
)
def test_bad_request_names_the_field(
    server: tuple[IngestService, ServerThread, Engine], body: bytes, status: int, word: str
) -> None:
    _, http, _ = server
    got_status, payload = asyncio.run(post_raw(http.url + "/v1/score", body))
    assert got_status == status, payload
    assert set(payload) == {"error"}
    assert payload["error"].startswith(word.split("[")[0]), payload
    assert word in payload["error"], payload
    assert "Traceback" not in payload["error"]


@pytest.mark.parametrize(
    ("content_type", "body"),
    [row[2:0:-1] for row in ODD_GOOD_REQUESTS],
    ids=[row[0] for row in ODD_GOOD_REQUESTS],
)
def test_odd_but_valid_requests_score(
    server: tuple[IngestService, ServerThread, Engine], content_type: str | None, body: bytes
) -> None:
    _, http, _ = server
    headers = {"Content-Type": content_type} if content_type is not None else {}

    async def post() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(http.url + "/v1/score", data=body, headers=headers) as response:
                return response.status, await response.json(content_type=None)

    status, payload = asyncio.run(post())
    assert status == 200, payload
    assert [(s["pod"], s["matched_blocks"]) for s in payload["scores"]] == [("pod-a", 4)]


TEN_MB = 10 * 1024 * 1024


async def post_oversized(url: str, size: int, *, expect100: bool) -> tuple[int, dict[str, Any]]:
    """POST a `size`-byte JSON body over a bare connection and read the answer; with `expect100` the body
    waits for a 100 Continue (what curl does for big bodies). The connection is then dropped: a server
    that refuses a body does not read it, so a graceful close would wait forever to flush the rest
    (aiohttp's client leaves its transport unclosed that way)."""
    body = b'{"model": "m", "token_ids": [' + b"1," * (size // 2) + b"1]}"
    target = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(target.hostname, target.port)
    try:
        head = [f"POST {target.path} HTTP/1.1", f"Host: {target.netloc}", "Content-Type: application/json"]
        head += [f"Content-Length: {len(body)}"] + (["Expect: 100-continue"] if expect100 else [])
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        if not expect100:
            writer.write(body)
        while True:
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 100:
                break
            writer.write(body)  # told to go on
        return status, json.loads(await reader.readexactly(int(headers["content-length"])))
    finally:
        writer.transport.abort()
        await writer.wait_closed()


@pytest.mark.parametrize("expect100", [False, True], ids=["plain", "expect-100-continue"])
def test_ten_megabyte_body_is_refused(
    server: tuple[IngestService, ServerThread, Engine], expect100: bool
) -> None:
    # With `Expect: 100-continue` (what curl sends for big bodies) the 413 comes before the body is sent.
    _, http, _ = server
    status, payload = asyncio.run(post_oversized(http.url + "/v1/score", TEN_MB, expect100=expect100))
    assert status == 413, payload
    assert payload["error"] == f"body: larger than the limit of {BODY_LIMIT} bytes"
    assert_good_request_scores(http)


def test_expect_100_continue_within_the_limit_is_served(
    server: tuple[IngestService, ServerThread, Engine],
) -> None:
    _, http, _ = server

    async def post() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            body = j({"model": "m", "token_ids": GOOD_TOKENS})
            async with session.post(http.url + "/v1/score", data=body, expect100=True) as response:
                return response.status, await response.json()

    status, payload = asyncio.run(post())
    assert status == 200 and payload["scores"][0]["matched_blocks"] == 4, payload


async def request(method: str, url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.request(method, url) as response:
            return response.status, await response.json()


def test_pods_the_service_does_not_know_are_named_in_the_answer(
    server: tuple[IngestService, ServerThread, Engine],
) -> None:
    # A typo in `pods` scores nothing for that pod, which looks like an empty cache: the answer says so.
    _, http, _ = server
    url = http.url + "/v1/score"
    asked = ["gone", "pod-a", "pod-idle", "gone", "pod-b"]
    status, payload = asyncio.run(post_raw(url, j({"model": "m", "token_ids": GOOD_TOKENS, "pods": asked})))
    assert status == 200, payload
    assert payload["unknown_pods"] == ["gone", "pod-b"]  # pod-idle has a stream, only no block yet
    assert [(s["pod"], s["matched_blocks"]) for s in payload["scores"]] == [("pod-a", 4)]
    # pod-a is a pod of model m, not of m2.
    status, payload = asyncio.run(
        post_raw(url, j({"model": "m2", "token_ids": GOOD_TOKENS, "pods": ["pod-a"]}))
    )
    assert status == 200 and payload["unknown_pods"] == ["pod-a"], payload
    status, payload = asyncio.run(
        post_raw(url, j({"model": "m", "token_ids": GOOD_TOKENS, "pods": ["pod-a"]}))
    )
    assert status == 200 and payload["unknown_pods"] == [], payload
    # Without `pods` the answer is as before: no unknown_pods key.
    status, payload = asyncio.run(post_raw(url, j({"model": "m", "token_ids": GOOD_TOKENS})))
    assert status == 200 and "unknown_pods" not in payload, payload


def test_unknown_routes_and_methods_are_json_errors(
    server: tuple[IngestService, ServerThread, Engine],
) -> None:
    _, http, _ = server
    status, payload = asyncio.run(request("GET", http.url + "/v2/nothing"))
    assert status == 404 and payload["error"].startswith("path:")
    status, payload = asyncio.run(request("GET", http.url + "/v1/score"))
    assert status == 405 and payload["error"].startswith("method:")


def ingest_state(service: IngestService) -> tuple[object, ...]:
    """What a request must never change. Replay and duplicate counts are left out: quiet-pod probes
    (TEST_INGEST probes after 0.3 s) replay on their own schedule, whatever the HTTP side does."""
    counters = msgspec.structs.asdict(service.counters())
    del counters["replays"], counters["duplicates"]
    pods = [(p.pod, p.dp_rank, p.state, p.last_seq, p.blocks, p.events_total) for p in service.pod_statuses()]
    runtime = service.model("m")
    assert runtime is not None
    return counters, pods, runtime.index.num_keys(), runtime.index.num_entries()


async def mixed_requests(url: str) -> list[tuple[str, int, dict[str, Any]]]:
    """Every bad request and as many good ones, interleaved and in flight together."""
    good = j({"model": "m", "token_ids": GOOD_TOKENS})
    labelled = [(name, body) for name, body, _, _ in BAD_REQUESTS]
    labelled = [
        item for pair in zip(labelled, [("good", good)] * len(labelled), strict=True) for item in pair
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(name: str, body: bytes) -> tuple[str, int, dict[str, Any]]:
            headers = {"Content-Type": "application/json"}
            async with session.post(url, data=body, headers=headers) as response:
                return name, response.status, await response.json()

        return await asyncio.gather(*(one(name, body) for name, body in labelled))


def test_concurrent_bad_and_good_requests(server: tuple[IngestService, ServerThread, Engine]) -> None:
    service, http, _ = server
    before = ingest_state(service)
    expected = {name: status for name, _, status, _ in BAD_REQUESTS}
    results = asyncio.run(mixed_requests(http.url + "/v1/score"))
    for name, status, payload in results:
        if name == "good":
            assert status == 200, payload
            assert [(s["pod"], s["matched_blocks"]) for s in payload["scores"]] == [("pod-a", 4)]
        else:
            assert status == expected[name], (name, payload)
    assert_good_request_scores(http)
    assert ingest_state(service) == before


def test_server_still_serves_and_ingests_after_every_bad_request(
    server: tuple[IngestService, ServerThread, Engine],
) -> None:
    service, http, engine = server
    before = ingest_state(service)
    for _, body, _, _ in BAD_REQUESTS:
        asyncio.run(post_raw(http.url + "/v1/score", body))
    assert_good_request_scores(http)
    assert ingest_state(service) == before
    # Ingest is undisturbed: a new batch still lands.
    more = list(range(5000, 5000 + 32))
    keys = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(more)
    engine.store(keys, more, block_size=16)
    wait_until_ingested(service, [engine])
    status, payload = asyncio.run(post_raw(http.url + "/v1/score", j({"model": "m", "token_ids": more})))
    assert status == 200 and payload["scores"][0]["matched_blocks"] == 2
