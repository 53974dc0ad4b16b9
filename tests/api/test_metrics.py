"""GET /metrics: ingest counters, pod states and index sizes read at scrape time, plus the API's own
request metrics, from a real server fed by a real engine stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from api_harness import Engine, ServerThread, new_engine, start_service, wait_until_ingested
from kvindex.api.app import create_app
from kvindex.hashing import BlockHasher
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from prometheus_client.parser import text_string_to_metric_families

MODEL = ModelConfig(name="m", block_size=16, hash_seed="0")
PROMPT = list(range(7, 7 + 5 * 16))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[IngestService, ServerThread, Engine]]:
    engine = new_engine("pod-a", "m")
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
        engine.publisher.close()


async def fetch(method: str, url: str, json: object = None) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.request(method, url, json=json) as response:
            return response.status, await response.text()


def scrape(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = asyncio.run(fetch("GET", server.url + "/metrics"))
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
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


def test_each_app_has_its_own_registry(served: tuple[IngestService, ServerThread, Engine]) -> None:
    service, _, _ = served
    # Building several apps over one service must not collide in a global registry.
    first, second = create_app(service), create_app(service)
    assert first is not second
