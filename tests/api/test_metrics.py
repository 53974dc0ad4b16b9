"""GET /metrics: ingest counters, pod states and index sizes read at scrape time, plus the API's own
request metrics, from a real server fed by a real engine stream."""

from __future__ import annotations

import asyncio
import platform
import re
from collections.abc import Iterator
from importlib.metadata import version

import aiohttp
import msgspec
import pytest
from api_harness import TEST_INGEST, ServerThread, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.app import create_app
from kvindex.api.metrics import COUNTER_METRICS, KNOWN_LABEL_VALUES, ingest_counter_families
from kvindex.hashing import BlockHasher
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import IngestCounters
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

MODEL = ModelConfig(name="m", block_size=16, hash_seed="0")
PROMPT = list(range(7, 7 + 5 * 16))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[IngestService, ServerThread, Engine]]:
    engine = Engine("pod-a", model="m")
    service = start_service([MODEL], [engine])
    server = ServerThread(service).start()
    try:
        keys = BlockHasher(algo="sha256", block_size=16, seed="0").event_hashes(PROMPT)
        engine.store(keys[:3], PROMPT[: 3 * 16], block_size=16)
        engine.store(keys[3:], PROMPT[3 * 16 :], block_size=16, parent=keys[2])
        engine.remove([keys[4]])
        wait_until_ingested(service, [engine])
        yield service, server, engine
    finally:
        server.stop()
        service.stop()
        engine.close()


async def fetch(method: str, url: str, json: object = None) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.request(method, url, json=json) as response:
            return response.status, await response.text()


def scrape_text(server: ServerThread) -> str:
    status, text = asyncio.run(fetch("GET", server.url + "/metrics"))
    assert status == 200
    return text


def scrape(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(scrape_text(server)):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_ingest_metrics_reflect_what_the_engine_published(
    served: tuple[IngestService, ServerThread, Engine],
) -> None:
    _, server, engine = served
    samples = scrape(server)
    assert samples[("kvindex_events_applied_total", (("type", "BlockStored"),))] == 2
    assert samples[("kvindex_events_applied_total", (("type", "BlockRemoved"),))] == 1
    assert samples[("kvindex_gaps_total", ())] == 0
    assert samples[("kvindex_hash_mismatches_total", ())] == 0
    for name in (
        "kvindex_restarts_total",
        "kvindex_block_size_mismatches_total",
        "kvindex_unknown_parents_total",
        "kvindex_non_prefix_group_events_total",
    ):
        assert (name, ()) in samples
    stream = (("dp_rank", "0"), ("model", "m"), ("pod", "pod-a"))
    states = {labels: value for (name, labels), value in samples.items() if name == "kvindex_pod_state"}
    assert sum(states.values()) == 1  # one-hot
    assert states[tuple(sorted((*stream, ("state", "live"))))] == 1
    assert samples[("kvindex_pod_last_event_age_seconds", stream)] >= 0
    assert samples[("kvindex_pod_blocks", stream)] == 4  # 5 stored, 1 removed
    assert samples[("kvindex_index_keys", (("model", "m"),))] == 4
    assert samples[("kvindex_index_entries", (("model", "m"),))] == 4
    assert samples[("kvindex_pod_events_total", stream)] == 3
    assert samples[("kvindex_pod_last_seq", stream)] == engine.publisher.last_seq
    assert (
        samples[("kvindex_pod_info", tuple(sorted((*stream, ("endpoint", engine.publisher.endpoint)))))] == 1
    )
    # Counters that have not happened yet are still exported, at 0.
    assert samples[("kvindex_history_lost_total", ())] == 0
    assert ("kvindex_duplicates_total", ()) in samples
    for outcome in ("ok", "history_lost", "timeout", "error", "unavailable"):
        assert ("kvindex_replays_total", (("outcome", outcome),)) in samples
    assert samples[("kvindex_events_applied_total", (("type", "AllBlocksCleared"),))] == 0


def test_request_metrics(served: tuple[IngestService, ServerThread, Engine]) -> None:
    _, server, _ = served
    before = scrape(server)
    ok_key = ("kvindex_http_requests_total", (("route", "/v1/score"), ("status", "200")))
    bad_key = ("kvindex_http_requests_total", (("route", "/v1/score"), ("status", "400")))
    assert asyncio.run(fetch("POST", server.url + "/v1/score", {"token_ids": PROMPT}))[0] == 200
    assert asyncio.run(fetch("POST", server.url + "/v1/score", {"token_ids": []}))[0] == 400
    after = scrape(server)
    assert after[ok_key] - before.get(ok_key, 0) == 1
    assert after[bad_key] - before.get(bad_key, 0) == 1
    count = ("kvindex_score_latency_seconds_count", ())
    assert after[count] - before.get(count, 0) == 1  # only answered scores are timed
    # The best pod matched 4 blocks (block 4 was removed): it falls in the (2, 4] bucket.
    le4 = ("kvindex_score_matched_blocks_bucket", (("le", "4.0"),))
    le2 = ("kvindex_score_matched_blocks_bucket", (("le", "2.0"),))
    assert after[le4] - before.get(le4, 0) == 1
    assert after[le2] - before.get(le2, 0) == 0


def test_build_and_model_info(served: tuple[IngestService, ServerThread, Engine]) -> None:
    _, server, _ = served
    samples = scrape(server)
    build = ("kvindex_build_info", (("python", platform.python_version()), ("version", version("kvindex"))))
    assert samples[build] == 1
    assert (
        samples[("kvindex_model_info", (("block_size", "16"), ("hash_algo", "sha256"), ("model", "m")))] == 1
    )


def test_each_app_has_its_own_registry(served: tuple[IngestService, ServerThread, Engine]) -> None:
    service, _, _ = served
    # Building several apps over one service must not collide in a global registry.
    first, second = create_app(service), create_app(service)
    assert first is not second


def test_every_ingest_counter_field_is_exported() -> None:
    # Walk the struct, so a field added to IngestCounters cannot be forgotten here.
    fields = msgspec.structs.fields(IngestCounters)
    values = {}
    for i, field in enumerate(fields):
        assert field.name in COUNTER_METRICS, f"IngestCounters.{field.name} has no entry in COUNTER_METRICS"
        values[field.name] = {"probe": 1000 + i} if field.type == dict[str, int] else 1000 + i
    counters = msgspec.convert(values, IngestCounters)
    exported = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in ingest_counter_families(counters)
        for sample in family.samples
    }
    for i, field in enumerate(fields):
        name, _, label = COUNTER_METRICS[field.name]
        assert name.startswith("kvindex_") and not name.endswith("_total")
        labels = ((label, "probe"),) if label is not None else ()
        assert exported[(name + "_total", labels)] == 1000 + i, field.name
    for field_name, known in KNOWN_LABEL_VALUES.items():
        name, _, label = COUNTER_METRICS[field_name]
        for value in known:
            assert exported[(name + "_total", ((label, value),))] == 0


METRIC_NAME = re.compile(r"kvindex_[a-z][a-z0-9_]*")


def test_metric_names_follow_prometheus_conventions(
    served: tuple[IngestService, ServerThread, Engine],
) -> None:
    _, server, _ = served
    families = list(text_string_to_metric_families(scrape_text(server)))
    assert families
    for family in families:
        assert METRIC_NAME.fullmatch(family.name), family.name
        assert family.documentation, f"{family.name} has no HELP"
        if family.type == "counter":
            for sample in family.samples:
                assert sample.name in (family.name + "_total", family.name + "_created"), sample.name
        else:
            assert not family.name.endswith("_total"), (
                f"{family.name} is a {family.type} named like a counter"
            )
        if family.name.endswith(("_seconds", "_age_seconds")):
            assert family.type in ("gauge", "histogram")


def test_replay_unavailable_is_counted_for_a_stream_without_replay() -> None:
    engine = Engine("pod-noreplay", model="m")
    pod = PodConfig(pod_id="pod-noreplay", endpoint=engine.endpoint, model="m", replay_endpoint=None)
    service = IngestService([MODEL], [pod], settings=TEST_INGEST)
    service.start()
    server = ServerThread(service).start()
    try:
        # Joining needs a replay from seq 0; with no endpoint that is an `unavailable` replay.
        key = ("kvindex_replays_total", (("outcome", "unavailable"),))
        wait_for(lambda: scrape(server).get(key, 0) >= 1, what="an unavailable replay to be counted")
    finally:
        server.stop()
        service.stop()
        engine.close()
