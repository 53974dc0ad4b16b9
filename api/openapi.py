"""`GET /openapi.json`: the HTTP API described as OpenAPI 3.1, for client generators and API tools.

Every body schema is generated from the msgspec types the handlers encode and decode (api/schemas.py and
the Structs they hold), so a field appended to one is described without anyone writing it down; only the
paths, status codes and prose are written here. tests/api/test_openapi.py validates real responses against
the served document.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from importlib.metadata import version
from typing import Any

import msgspec
import msgspec.inspect
from aiohttp import web
from kvindex.api.schemas import (
    JSON_ENCODER,
    CompactScoreResponse,
    ErrorBody,
    HealthBody,
    PodsResponse,
    ReadyBody,
    ScoreRequest,
    ScoreResponse,
    StatusResponse,
)
from kvindex.indexer.status import IngestCounters

OPENAPI_VERSION = "3.1.0"  # its schema dialect is JSON Schema 2020-12, which msgspec emits
REF_TEMPLATE = "#/components/schemas/{name}"
BEARER_SCHEME = "bearerAuth"
REQUEST_TYPES = (ScoreRequest,)
RESPONSE_TYPES = (
    ScoreResponse,
    CompactScoreResponse,
    PodsResponse,
    IngestCounters,
    ErrorBody,
    HealthBody,
    ReadyBody,
    StatusResponse,
)


def openapi_document(*, bearer_auth: bool) -> dict[str, Any]:
    """The document for a server with (`bearer_auth`) or without an API key on /v1/*."""
    refs, schemas = msgspec.json.schema_components(
        (*REQUEST_TYPES, *RESPONSE_TYPES), ref_template=REF_TEMPLATE
    )
    (
        score_request,
        score_response,
        compact_score_response,
        pods_response,
        ingest_counters,
        error_body,
        health_body,
        ready_body,
        status_response,
    ) = refs
    _require_what_is_always_sent(schemas)

    def json_body(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    def error(description: str) -> dict[str, Any]:
        return json_body(description, error_body)

    def status_page(operation_id: str) -> dict[str, Any]:
        html = {"description": "one HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}
        summary = "The status page, for people (it polls /v1/status)"
        return {"get": {"operationId": operation_id, "summary": summary, "responses": {"200": html}}}

    protected: dict[str, Any] = {}
    auth_errors: dict[str, Any] = {}
    if bearer_auth:
        protected = {"security": [{BEARER_SCHEME: []}]}
        auth_errors = {"401": error("no or a wrong `Authorization: Bearer <API key>`")}

    paths = {
        "/v1/score": {
            "post": {
                "operationId": "score",
                "summary": "How many of the prompt's leading blocks each pod holds, best first",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": score_request}},
                },
                "responses": {
                    "200": json_body(
                        "scores, best first; pods holding none of the prompt are omitted (with "
                        '"answer": "compact", each entry as [pod, dp_rank, matched_blocks, score])',
                        # anyOf, not oneOf: an answer with no entries fits both.
                        {"anyOf": [score_response, compact_score_response]},
                    ),
                    "400": error("a bad request body; the message names the field"),
                    **auth_errors,
                    "404": error("unknown model"),
                    "413": error("body larger than the server's limit"),
                    "default": error("any other error"),
                },
                **protected,
            }
        },
        "/v1/pods": {
            "get": {
                "operationId": "pods",
                "summary": "Every (pod, DP rank) stream and the state of its ingest",
                "responses": {
                    "200": json_body("one entry per stream", pods_response),
                    **auth_errors,
                    "default": error("any other error"),
                },
                **protected,
            }
        },
        "/v1/ingest": {
            "get": {
                "operationId": "ingest",
                "summary": "The write path's process-wide counters (events applied, dropped, gaps, replays, ...)",
                "responses": {
                    "200": json_body("the counters /metrics exposes without per-pod labels", ingest_counters),
                    **auth_errors,
                    "default": error("any other error"),
                },
                **protected,
            }
        },
        "/v1/status": {
            "get": {
                "operationId": "status",
                "summary": "What the status page shows: the pods as /v1/pods, totals, the score histograms",
                "responses": {
                    "200": json_body("pods, totals, and the registry's score histograms", status_response),
                    **auth_errors,
                    "default": error("any other error"),
                },
                **protected,
            }
        },
        "/": status_page("status_page"),
        "/ui": status_page("status_page_ui"),
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness: the process is up",
                "responses": {"200": json_body("up", health_body)},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: subscriptions up and no pod in its initial sync",
                "responses": {
                    "200": json_body("ready", ready_body),
                    "503": json_body("not ready yet; `error` says why", ready_body),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics, names prefixed kvindex_",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": json_body("OpenAPI 3.1", {"type": "object"})},
            }
        },
    }
    components: dict[str, Any] = {"schemas": schemas}
    if bearer_auth:
        components["securitySchemes"] = {
            BEARER_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "the key kvindex serve was given (KVINDEX_API_KEY or --api-key)",
            }
        }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvindex",
            "version": version("kvindex"),
            "description": "Cross-pod KV-cache index for vLLM fleets; the contract is docs/CONTRACT.md.",
        },
        "paths": paths,
        "components": components,
    }


def _require_what_is_always_sent(schemas: dict[str, Any]) -> None:
    """Mark required every field a response always carries.

    msgspec's schema marks a field with a default optional, which is right for what it decodes and wrong
    for what we send: the encoder writes every field, except those left UNSET and, in an `omit_defaults`
    Struct, those at their default. Clients generated from the document then need no None checks for
    fields that are always there (`partial_view`, or any field later appended with a default). A Struct
    that requests use too keeps msgspec's view, since one component describes both.
    """
    decoded = set(_struct_types(REQUEST_TYPES))
    for struct in _struct_types(RESPONSE_TYPES):
        if struct in decoded:
            continue
        schema = schemas[struct.__name__]
        omit_defaults = struct.__struct_config__.omit_defaults
        schema["required"] = [
            field.encode_name
            for field in msgspec.structs.fields(struct)
            if field.required or not (omit_defaults or field.default is msgspec.UNSET)
        ]


def _struct_types(types: Iterable[type]) -> Iterator[type[msgspec.Struct]]:
    """Every Struct type reachable from `types` (fields, list items, dict values, union members), once."""
    seen: set[type] = set()
    pending: list[Any] = list(msgspec.inspect.multi_type_info(tuple(types)))
    while pending:
        node = pending.pop()
        if isinstance(node, msgspec.inspect.StructType):
            if node.cls in seen:
                continue
            seen.add(node.cls)
            yield node.cls
            pending.extend(field.type for field in node.fields)
        elif isinstance(node, msgspec.inspect.Type):
            for value in msgspec.structs.astuple(node):
                if isinstance(value, msgspec.inspect.Type):
                    pending.append(value)
                elif isinstance(value, tuple):
                    pending.extend(item for item in value if isinstance(item, msgspec.inspect.Type))


def openapi_handler(*, bearer_auth: bool) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The `GET /openapi.json` handler, with the document built and encoded once."""
    body = JSON_ENCODER.encode(openapi_document(bearer_auth=bearer_auth))

    async def handle_openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return handle_openapi
