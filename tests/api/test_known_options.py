"""ScoreHandler remembers the options of requests that passed (the body without its id array): a body with
known options must decode, validate and resolve exactly as it would the first time it was seen.

Each body of a random sequence goes to one long-lived handler (whose memory of options grows and is
cleared as it fills) and to a handler that has seen nothing; the two must give the same request and model,
or the same error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from extensions import require_built
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.api import id_arrays
from kvindex.api import score as score_module
from kvindex.api.metrics import RequestMetrics
from kvindex.api.schemas import RequestError, ScoreRequest
from kvindex.api.score import ScoreHandler
from kvindex.api.settings import ApiSettings
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.registry import ModelRuntime
from prometheus_client import CollectorRegistry

MAX_TOKENS = 64
MODELS = [
    ModelConfig(name="m", lora_adapters={"sql": "/adapters/sql"}),
    ModelConfig(name="m2", block_size=32),
]
# Options a router might send, valid or not, each with either key.
OPTIONS: list[dict[str, Any]] = [
    {"model": "m"},
    {"model": "m2", "answer": "compact"},
    {"model": "m", "answer": "compact", "rank": "score", "pods": ["pod-a", "pod-b"]},
    {"model": "m", "states": ["live", "silent"]},
    {"model": "m", "states": ["sleeping"]},  # no such state
    {"model": "m", "pods": []},  # empty pods
    {"model": "gpt-9"},  # unknown model: 404
    {},  # no model with two configured
    {"model": "m", "lora_name": "sql"},  # tokens only
    {"model": "m", "lora_name": "nope"},  # unknown adapter (found later, when hashing)
    {"model": "m", "cache_salt": "s"},
    {"model": "m", "lora_path": "/x"},  # needs lora_name
    {"model": "m", "mm": [{"identifier": "img", "offset": 0, "length": 2}]},  # never remembered
    {"model": "m", "answer": "brief"},  # not an answer style
    {"model": "m", "prompt": "hi"},  # text is refused
]
ID_COUNTS = [0, 1, 3, MAX_TOKENS, MAX_TOKENS + 1]


def built() -> Any:
    return require_built(id_arrays.find_ids, "kvindex.api._id_arrays", "a C compiler")


@pytest.fixture(scope="module")
def service() -> Iterator[IngestService]:
    service = IngestService(MODELS, listen="tcp://127.0.0.1:*")  # never started: only its models are read
    yield service
    service.stop()


def handler(service: IngestService, executor: ThreadPoolExecutor) -> ScoreHandler:
    metrics = RequestMetrics(CollectorRegistry(auto_describe=False))
    return ScoreHandler(service, ApiSettings(max_tokens=MAX_TOKENS), metrics, executor, executor)


def outcome(parse: Any, body: bytes) -> tuple[str, Any]:
    try:
        request, runtime = parse(body)
    except RequestError as exc:
        return "error", (exc.field, exc.problem, exc.status)
    assert isinstance(request, ScoreRequest) and isinstance(runtime, ModelRuntime)
    as_lists = {
        name: list(value) if name in ("token_ids", "block_hashes") and value is not None else value
        for name, value in ((field, getattr(request, field)) for field in request.__struct_fields__)
    }
    return "ok", (as_lists, runtime.config.name)


bodies = st.builds(
    lambda options, key, count, first, compact: json.dumps(
        {**options, key: [(first + i) % 1000 for i in range(count)]},
        separators=(",", ":") if compact else (", ", ": "),
    ).encode(),
    st.sampled_from(OPTIONS),
    st.sampled_from(["token_ids", "block_hashes"]),
    st.sampled_from(ID_COUNTS),
    st.integers(0, 999),
    st.booleans(),
)


@given(sequence=st.lists(bodies, min_size=1, max_size=40))
@settings(max_examples=150, deadline=None)
def test_known_options_parse_as_the_first_time(service: IngestService, sequence: list[bytes]) -> None:
    built()
    with ThreadPoolExecutor(1) as executor:
        remembering = handler(service, executor)
        for body in sequence:
            fresh = handler(service, executor)
            assert outcome(remembering._parse, body) == outcome(fresh._parse, body), body


def test_what_is_remembered_is_bounded(service: IngestService, monkeypatch: pytest.MonkeyPatch) -> None:
    built()
    monkeypatch.setattr(score_module, "OPTIONS_CACHE_ENTRIES", 4)
    with ThreadPoolExecutor(1) as executor:
        remembering = handler(service, executor)
        for n in range(10):
            body = json.dumps({"model": "m", "pods": [f"pod-{n}"], "block_hashes": [1, 2]}).encode()
            remembering._parse(body)
            assert 1 <= len(remembering._known_options) <= 4
        big = json.dumps({"model": "m", "pods": ["p" * 5000], "block_hashes": [1]}).encode()
        before = dict(remembering._known_options)
        remembering._parse(big)
        assert remembering._known_options == before  # options over OPTIONS_CACHE_MAX_BYTES are not kept
