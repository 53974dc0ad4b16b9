"""GET /openapi.json against real answers: a real server over a real ingest service fed by a real engine
stream, every documented answer provoked for real (200s, 4xx, the 401 of the API key, /readyz's 503) and
each body validated, with jsonschema, against the schema the served document gives for that path, method,
status and content type.

The document's object schemas stay open (clients must tolerate fields appended later); here they are
closed, so a field a handler sends that the document does not describe fails too.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonschema
import pytest
from api_harness import ServerThread, raw_exchange, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.app import create_app
from kvindex.api.settings import ApiKey, ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig

KEY = "kvi-openapi-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
MODELS = [
    ModelConfig(name="m", block_size=16, hash_seed="0"),
    ModelConfig(name="m2", block_size=16, hash_seed="0"),
]
TOKENS = list(range(100, 100 + 64))
BLOCK_KEYS = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(TOKENS)


class Servers:
    """One service, two apps over it: `keyed` with an API key and a small body limit; `open` without a
    key and wanting more live pods than there are, so its /readyz answers 503."""

    def __init__(self, service: IngestService) -> None:
        self.service = service
        self.keyed_settings = ApiSettings(
            host="127.0.0.1", port=0, max_body_bytes=BODY_LIMIT, api_key=ApiKey(KEY)
        )
        self.open_settings = ApiSettings(host="127.0.0.1", port=0, min_live_pods=2)
        self.keyed = ServerThread(service, self.keyed_settings)
        self.open = ServerThread(service, self.open_settings)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    engine = Engine("pod-a", model="m")
    service = start_service(MODELS, [engine])
    both = Servers(service)
    try:
        both.keyed.start()
        both.open.start()
        engine.store(BLOCK_KEYS, TOKENS, block_size=16)
        wait_until_ingested(service, [engine])
        yield both
    finally:
        both.keyed.stop()
        both.open.stop()
        service.stop()
        engine.close()


class Answer:
    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status = status
        self.media_type = content_type.split(";")[0].strip()
        self.body = body


async def send(
    method: str, url: str, *, json_body: Any = None, raw: bytes | None = None, auth: bool = True
) -> Answer:
    headers = dict(BEARER) if auth else {}
    data = raw if raw is not None else (None if json_body is None else json.dumps(json_body).encode())
    if data is not None:
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.request(method, url, data=data, headers=headers) as response:
            return Answer(response.status, response.headers.get("Content-Type", ""), await response.read())


def fetch_document(server: ServerThread) -> dict[str, Any]:
    answer = asyncio.run(send("GET", server.url + "/openapi.json", auth=False))
    assert answer.status == 200 and answer.media_type == "application/json"
    document: dict[str, Any] = json.loads(answer.body)
    return document


def closed(schema: Any) -> Any:
    """`schema` with every object that lists properties refusing any other."""
    if isinstance(schema, dict):
        out = {key: closed(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    return schema


def response_schema(document: dict[str, Any], path: str, method: str, status: int, media_type: str) -> Any:
    responses = document["paths"][path][method]["responses"]
    response = responses.get(str(status), responses.get("default"))
    assert response is not None, (
        f"{method.upper()} {path} answered {status}, which the document does not list"
    )
    content = response["content"]
    assert media_type in content, (
        f"{method.upper()} {path} {status} sent {media_type}, documented {list(content)}"
    )
    return content[media_type]["schema"]


def validate(document: dict[str, Any], schema: Any, instance: Any, *, close: bool) -> None:
    """`instance` against `schema`, resolving refs in the document's components (closed if `close`)."""
    components = closed(document["components"]) if close else copy.deepcopy(document["components"])
    root = {"$schema": "https://json-schema.org/draft/2020-12/schema", "components": components}
    root.update(closed(schema) if close else schema)
    jsonschema.Draft202012Validator(root).validate(instance)


# (id, method, path, JSON request body or raw bytes, the status it must get)
KEYED_EXCHANGES: list[tuple[str, str, str, Any, int]] = [
    ("score by token ids", "post", "/v1/score", {"model": "m", "token_ids": TOKENS}, 200),
    ("score by block hashes", "post", "/v1/score", {"model": "m", "block_hashes": BLOCK_KEYS}, 200),
    (
        "score with every option",
        "post",
        "/v1/score",
        {
            "model": "m",
            "token_ids": TOKENS,
            "cache_salt": "tenant-a",
            "mm": [{"identifier": "img", "offset": 3, "length": 5}],
            "pods": ["pod-a"],
            "states": ["live", "silent"],
            "rank": "score",
        },
        200,
    ),
    ("score held by nobody", "post", "/v1/score", {"model": "m2", "token_ids": TOKENS}, 200),
    ("compact score", "post", "/v1/score", {"model": "m", "token_ids": TOKENS, "answer": "compact"}, 200),
    ("unknown answer", "post", "/v1/score", {"model": "m", "token_ids": TOKENS, "answer": "short"}, 400),
    ("malformed JSON", "post", "/v1/score", b'{"model": "m", "token_ids": [1,', 400),
    (
        "both tokens and hashes",
        "post",
        "/v1/score",
        {"model": "m", "token_ids": [1], "block_hashes": [1]},
        400,
    ),
    ("negative token id", "post", "/v1/score", {"model": "m", "token_ids": [-1]}, 400),
    ("unknown state", "post", "/v1/score", {"model": "m", "token_ids": [1], "states": ["asleep"]}, 400),
    ("model omitted with two models", "post", "/v1/score", {"token_ids": [1]}, 400),
    ("unknown model", "post", "/v1/score", {"model": "gpt-9", "token_ids": TOKENS}, 404),
    ("pods", "get", "/v1/pods", None, 200),
    ("ingest counters", "get", "/v1/ingest", None, 200),
    ("status", "get", "/v1/status", None, 200),
    ("status page", "get", "/", None, 200),
    ("status page at /ui", "get", "/ui", None, 200),
    ("healthz", "get", "/healthz", None, 200),
    ("readyz", "get", "/readyz", None, 200),
    ("metrics", "get", "/metrics", None, 200),
    ("openapi", "get", "/openapi.json", None, 200),
]


def decoded(answer: Answer) -> Any:
    return json.loads(answer.body) if answer.media_type == "application/json" else answer.body.decode()


def test_served_document_is_openapi_31_with_valid_schemas(servers: Servers) -> None:
    for server, keyed in ((servers.keyed, True), (servers.open, False)):
        document = fetch_document(server)
        assert document["openapi"] == "3.1.0"
        assert document["info"]["title"] == "kvindex"
        for schema in document["components"]["schemas"].values():
            jsonschema.Draft202012Validator.check_schema(schema)
        schemes = document["components"].get("securitySchemes", {})
        if keyed:
            assert (schemes["bearerAuth"]["type"], schemes["bearerAuth"]["scheme"]) == ("http", "bearer")
        else:
            assert schemes == {}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                protected = keyed and path.startswith("/v1/")
                assert operation.get("security") == ([{"bearerAuth": []}] if protected else None), (
                    path,
                    method,
                )
                assert ("401" in operation["responses"]) == protected, (path, method)


def test_every_route_is_documented(servers: Servers) -> None:
    app = create_app(servers.service, servers.keyed_settings)
    routes = {
        (route.resource.canonical, route.method.lower())
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    documented = {
        (path, method) for path, ops in fetch_document(servers.keyed)["paths"].items() for method in ops
    }
    assert routes == documented, "describe each route in api/openapi.py's paths"


def test_real_answers_match_the_served_schemas(servers: Servers) -> None:
    document = fetch_document(servers.keyed)
    seen: set[tuple[str, str, str]] = set()
    for name, method, path, body, status in KEYED_EXCHANGES:
        raw = body if isinstance(body, bytes) else None
        answer = asyncio.run(send(method, servers.keyed.url + path, json_body=None if raw else body, raw=raw))
        assert answer.status == status, (name, answer.body)
        instance = decoded(answer)
        validate(
            document, response_schema(document, path, method, status, answer.media_type), instance, close=True
        )
        operation = document["paths"][path][method]
        seen.add((path, method, str(status)))
        if status == 200 and isinstance(body, dict):  # a request the server takes fits the request schema
            validate(
                document, operation["requestBody"]["content"]["application/json"]["schema"], body, close=False
            )
        if name == "score by token ids":
            (entry,) = instance["scores"]
            assert (entry["pod"], entry["matched_blocks"], entry["state"]) == ("pod-a", 4, "live")
        if name == "compact score":
            assert instance["scores"] == [["pod-a", 0, 4, 4.0]]

    # The 401 of the key, /readyz's 503 (the open server wants two live pods), a 413 refused before
    # the body is sent.
    for path in ("/v1/pods", "/v1/ingest", "/v1/status"):
        refused = asyncio.run(send("get", servers.keyed.url + path, auth=False))
        assert refused.status == 401
        validate(
            document,
            response_schema(document, path, "get", 401, refused.media_type),
            decoded(refused),
            close=True,
        )
        seen.add((path, "get", "401"))
    refused = asyncio.run(
        send("post", servers.keyed.url + "/v1/score", json_body={"token_ids": TOKENS}, auth=False)
    )
    assert refused.status == 401
    validate(
        document,
        response_schema(document, "/v1/score", "post", 401, refused.media_type),
        decoded(refused),
        close=True,
    )
    seen.add(("/v1/score", "post", "401"))

    open_document = fetch_document(servers.open)
    not_ready = asyncio.run(send("get", servers.open.url + "/readyz", auth=False))
    assert not_ready.status == 503
    body = decoded(not_ready)
    assert body["ready"] is False and body["live_pods"] == 1 and body["error"]
    validate(
        open_document,
        response_schema(open_document, "/readyz", "get", 503, not_ready.media_type),
        body,
        close=True,
    )
    seen.add(("/readyz", "get", "503"))

    head: list[str | bytes] = [
        "POST /v1/score HTTP/1.1",
        "Content-Type: application/json",
        "Expect: 100-continue",
        f"Authorization: Bearer {KEY}",
    ]
    statuses, headers, raw_body = asyncio.run(raw_exchange(servers.keyed.url, head, b"1" * (2 * BODY_LIMIT)))
    assert statuses == [413]
    media_type = headers["content-type"].split(";")[0]
    validate(
        document,
        response_schema(document, "/v1/score", "post", 413, media_type),
        json.loads(raw_body),
        close=True,
    )
    seen.add(("/v1/score", "post", "413"))
    # An answer the document lists only under "default": an Expect the server does not know (417).
    head[2] = "Expect: something-else"
    statuses, headers, raw_body = asyncio.run(raw_exchange(servers.keyed.url, head, b"{}"))
    assert statuses == [417]
    media_type = headers["content-type"].split(";")[0]
    validate(
        document,
        response_schema(document, "/v1/score", "post", 417, media_type),
        json.loads(raw_body),
        close=True,
    )

    documented = {
        (path, method, status)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        for status in operation["responses"]
        if status != "default"  # 5xx and the like: not provoked from outside
    }
    assert documented <= seen, f"documented but never provoked here: {sorted(documented - seen)}"


def test_schemas_describe_what_is_sent_not_what_is_decoded(servers: Servers) -> None:
    """Fields with a default are still always sent, so responses require them; requests do not."""
    schemas = fetch_document(servers.keyed)["components"]["schemas"]
    assert set(schemas["PodStatus"]["required"]) == set(schemas["PodStatus"]["properties"])
    assert set(schemas["PodScore"]["required"]) == set(schemas["PodScore"]["properties"])
    assert "state" in schemas["PodScore"]["required"]
    assert schemas["ReadyBody"]["required"] == ["ready", "live_pods"]  # error only when not ready
    assert schemas["ScoreRequest"]["required"] == []
