"""The optional API key (vLLM's `--api-key` convention) against a real server fed by a real engine stream:
/v1/* answers 401 in our error shape without `Authorization: Bearer <key>`, and serves with it; health,
readiness, metrics and /openapi.json stay open."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest
from api_harness import HttpAnswer as Answer
from api_harness import ServerThread, raw_exchange, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.settings import ApiKey, ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.model import ModelConfig
from prometheus_client.parser import text_string_to_metric_families

KEY = "kvi-test-4f9c2a1e8b7d"
MODEL = ModelConfig(name="m", block_size=16, hash_seed="0")
TOKENS = list(range(100, 100 + 64))
SCORE_BODY = json.dumps({"model": "m", "token_ids": TOKENS}).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = Engine("pod-a", model="m")
    service = start_service([MODEL], [engine])
    http = ServerThread(service, ApiSettings(host="127.0.0.1", port=0, api_key=ApiKey(KEY))).start()
    try:
        keys = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(TOKENS)
        engine.store(keys, TOKENS, block_size=16)
        wait_until_ingested(service, [engine])
        yield http
    finally:
        http.stop()
        service.stop()
        engine.close()


async def send(
    method: str, url: str, *, headers: dict[str, str] | None = None, body: bytes | None = None
) -> Answer:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.request(method, url, data=body, headers=headers or {}) as response:
            return Answer(response.status, dict(response.headers), await response.read())


def call(server: ServerThread, method: str, path: str, authorization: str | None) -> Answer:
    headers = {} if authorization is None else {"Authorization": authorization}
    body = SCORE_BODY if method == "POST" else None
    return asyncio.run(send(method, server.url + path, headers=headers, body=body))


PROTECTED = [("POST", "/v1/score"), ("GET", "/v1/pods"), ("GET", "/v1/no-such-route")]
# (id, Authorization header or None, the error message, the WWW-Authenticate challenge)
REFUSED = [
    ("no header", None, "authorization: missing; send Authorization: Bearer <API key>", "Bearer"),
    ("wrong key", "Bearer not-the-key", "authorization: wrong API key", 'Bearer error="invalid_token"'),
    ("key with a suffix", f"Bearer {KEY}x", "authorization: wrong API key", 'Bearer error="invalid_token"'),
    ("key's prefix", f"Bearer {KEY[:-1]}", "authorization: wrong API key", 'Bearer error="invalid_token"'),
    ("empty bearer", "Bearer", "authorization: wrong API key", 'Bearer error="invalid_token"'),
    (
        "key without a scheme",
        KEY,
        "authorization: expected the Bearer scheme (Authorization: Bearer <API key>)",
        'Bearer error="invalid_request"',
    ),
    (
        "basic auth",
        "Basic dXNlcjpwYXNz",
        "authorization: expected the Bearer scheme (Authorization: Bearer <API key>)",
        'Bearer error="invalid_request"',
    ),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[path for _, path in PROTECTED])
@pytest.mark.parametrize(
    ("authorization", "message", "challenge"), [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED]
)
def test_v1_without_the_key_is_401(
    server: ServerThread, method: str, path: str, authorization: str | None, message: str, challenge: str
) -> None:
    answer = call(server, method, path, authorization)
    assert answer.status == 401, answer.body
    assert answer.json() == {"error": message}
    assert answer.headers["Content-Type"].startswith("application/json")
    assert answer.headers["WWW-Authenticate"] == challenge
    assert KEY.encode() not in answer.body


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}"])
def test_v1_with_the_key_is_served(server: ServerThread, authorization: str) -> None:
    scored = call(server, "POST", "/v1/score", authorization)
    assert scored.status == 200, scored.body
    assert [(s["pod"], s["matched_blocks"]) for s in scored.json()["scores"]] == [("pod-a", 4)]
    pods = call(server, "GET", "/v1/pods", authorization)
    assert pods.status == 200 and [p["pod"] for p in pods.json()["pods"]] == ["pod-a"]
    # Past the key, the usual answers: a route that does not exist is a 404.
    missing = call(server, "GET", "/v1/no-such-route", authorization)
    assert missing.status == 404 and missing.json()["error"].startswith("path:")


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/openapi.json", "/no-such-page"])
def test_health_metrics_and_the_rest_stay_open(server: ServerThread, path: str) -> None:
    answer = call(server, "GET", path, None)
    assert answer.status == (404 if path == "/no-such-page" else 200), answer.body
    assert "WWW-Authenticate" not in answer.headers


def test_options_passes_like_vllm(server: ServerThread) -> None:
    # A CORS preflight carries no credentials; vLLM lets OPTIONS through. Here it reaches the router (405).
    answer = call(server, "OPTIONS", "/v1/score", None)
    assert answer.status == 405 and answer.json()["error"].startswith("method:")


def test_refusals_are_counted_by_route(server: ServerThread) -> None:
    def refused_count() -> float:
        text = call(server, "GET", "/metrics", None).body.decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvindex_http_requests_total" and sample.labels == {
                    "route": "/v1/score",
                    "status": "401",
                }:
                    return sample.value
        return 0.0

    before = refused_count()
    call(server, "POST", "/v1/score", None)
    call(server, "POST", "/v1/score", "Bearer wrong")
    assert refused_count() == before + 2


def test_expect_100_continue_without_the_key_is_refused_before_the_body(server: ServerThread) -> None:
    head: list[str | bytes] = [
        "POST /v1/score HTTP/1.1",
        "Content-Type: application/json",
        "Expect: 100-continue",
    ]
    statuses, _, body = asyncio.run(raw_exchange(server.url, head, SCORE_BODY))
    assert statuses == [401]  # no 100 Continue: the body was never asked for
    assert json.loads(body)["error"].startswith("authorization: missing")
    # With the key: 100 Continue, then the score.
    statuses, _, body = asyncio.run(
        raw_exchange(server.url, [*head, f"Authorization: Bearer {KEY}"], SCORE_BODY)
    )
    assert statuses == [100, 200]
    assert json.loads(body)["scores"][0]["matched_blocks"] == 4


def test_header_bytes_that_are_not_utf8_are_a_401_not_a_500(server: ServerThread) -> None:
    head: list[str | bytes] = ["GET /v1/pods HTTP/1.1", b"Authorization: Bearer \xff\xfe" + KEY.encode()]
    statuses, _, body = asyncio.run(raw_exchange(server.url, head))
    assert statuses == [401]
    assert json.loads(body) == {"error": "authorization: wrong API key"}


def test_the_key_is_not_in_the_settings_repr() -> None:
    settings = ApiSettings(api_key=ApiKey(KEY))
    assert KEY not in repr(settings) and KEY not in str(settings)
    assert settings.api_key == ApiKey(KEY) and settings.api_key != ApiKey(KEY + "x")
