"""What a router can tell from each answer: every score entry carries its pod's state and event age; a
killed engine's blocks are flagged, then left out, then forgotten; `states` and `rank` choose what is
trusted; /readyz counts live pods and is not held back by one that cannot be reached. Real engines, real
ZMQ and a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from answer_paths import answer_writer  # noqa: F401  (a fixture)
from api_harness import ServerThread, wait_until_ingested
from engines import Engine
from kvindex.api.settings import ApiSettings
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from waiting import wait_for

# Every score request here runs through both answer writers (api/answer.py).
pytestmark = pytest.mark.usefixtures("answer_writer")

MODEL = ModelConfig(name="m")
BLOCK = 16


async def _request(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(method, url, json=body) as response:
        return response.status, await response.json()


def score(server: ServerThread, body: dict[str, Any], expect: int = 200) -> Any:
    status, payload = asyncio.run(_request("POST", server.url + "/v1/score", body))
    assert status == expect, payload
    return payload


def readyz(server: ServerThread) -> tuple[int, Any]:
    return asyncio.run(_request("GET", server.url + "/readyz"))


def shared_prompt(engines: list[Engine], blocks_each: list[int]) -> list[int]:
    """One prompt; engine i holds its first blocks_each[i] blocks (real hashes)."""
    tokens = list(range(1, BLOCK * max(blocks_each) + 1))
    keys = engines[0].hasher.event_hashes(tokens)
    for engine, n in zip(engines, blocks_each, strict=True):
        engine.store(keys[:n], tokens[: n * BLOCK], block_size=BLOCK)
    return tokens


def serve(
    engines: list[Engine], pods: list[PodConfig], ingest: IngestSettings, api: ApiSettings | None = None
):  # type: ignore[no-untyped-def]
    service = IngestService([MODEL], pods, settings=ingest)
    service.start()
    server = ServerThread(service, api or ApiSettings(host="127.0.0.1", port=0)).start()
    return service, server


FAST = IngestSettings(
    quiet_probe_after_s=0.3, replay_timeout_s=1.0, disconnected_grace_s=1.0, forget_after_s=3.0
)


def test_a_killed_engine_is_flagged_then_left_out_then_forgotten(
    engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvindex.indexer.ingest")
    engines += [Engine("pod-a"), Engine("pod-b")]
    service, server = serve(engines, [e.pod_config() for e in engines], FAST)
    try:
        wait_for(service.ready, what="initial sync")
        prompt = shared_prompt(engines, [4, 2])
        wait_until_ingested(service, engines)
        body = {"model": "m", "token_ids": prompt}
        answer = score(server, body)
        assert [(e["pod"], e["state"]) for e in answer["scores"]] == [("pod-a", "live"), ("pod-b", "live")]
        assert all(e["last_event_age_s"] >= 0 for e in answer["scores"])
        assert all(round(e["last_event_age_s"], 3) == e["last_event_age_s"] for e in answer["scores"])  # ms

        def logged(text: str) -> bool:
            return any(
                text in r.getMessage() for r in caplog.records if "pod pod-a rank 0:" in r.getMessage()
            )

        wait_for(lambda: logged("-> live"), what="pod-a's state logged live")
        engines[0].close()  # pod-a's engine dies: its blocks are ghosts now
        wait_for(lambda: service.pod_health("pod-a", 0).state == "disconnected", what="pod-a disconnected")  # type: ignore[union-attr]
        answer = score(server, body)
        # Within the grace: still answered, flagged, and below the live pod although it matches more.
        assert [(e["pod"], e["state"]) for e in answer["scores"]] == [
            ("pod-b", "live"),
            ("pod-a", "disconnected"),
        ]
        by_score = score(server, body | {"rank": "score"})
        assert [e["pod"] for e in by_score["scores"]] == ["pod-a", "pod-b"]
        live_only = score(server, body | {"states": ["live"]})
        assert [e["pod"] for e in live_only["scores"]] == ["pod-b"]

        def left_out() -> bool:
            return [e["pod"] for e in score(server, body)["scores"]] == ["pod-b"]

        wait_for(left_out, what="pod-a left out past the grace")
        asked = score(server, body | {"states": ["disconnected"]})
        assert [e["pod"] for e in asked["scores"]] == ["pod-a"]  # kept, for whoever asks

        index = service.model("m").index  # type: ignore[union-attr]
        pod_a = engines[0].ref
        wait_for(lambda: index.pod_block_count(pod_a) == 0, what="pod-a forgotten")
        assert score(server, body | {"states": ["disconnected"]})["scores"] == []
        messages = [r.getMessage() for r in caplog.records if "pod-a" in r.getMessage()]
        assert sum("live -> disconnected" in m for m in messages) == 1, messages
        assert any("dropped its" in m and "fresh join" in m for m in messages), messages
    finally:
        server.stop()
        service.stop()


def test_readyz_needs_a_live_pod_and_is_not_held_back_by_an_unreachable_one(engines: list[Engine]) -> None:
    dead = PodConfig("pod-dead", "tcp://127.0.0.1:1", "m", replay_endpoint="tcp://127.0.0.1:1")
    # Only an unreachable pod: not ready, and the body says why.
    service, server = serve(engines, [dead], FAST)
    try:
        status, body = readyz(server)
        assert status == 503 and body["ready"] is False and "live" in body["error"], body
    finally:
        server.stop()
        service.stop()
    engines.append(Engine("pod-a"))
    service, server = serve(engines, [dead, engines[0].pod_config()], FAST)
    try:
        wait_for(lambda: readyz(server)[0] == 200, what="ready with one live pod of two")
        assert readyz(server)[1] == {"ready": True, "live_pods": 1}
    finally:
        server.stop()
        service.stop()
    service, server = serve(
        engines, [engines[0].pod_config()], FAST, ApiSettings(host="127.0.0.1", port=0, min_live_pods=2)
    )
    try:
        wait_for(lambda: service.pod_health("pod-a", 0).state == "live", what="pod-a live")  # type: ignore[union-attr]
        status, body = readyz(server)
        assert status == 503 and "at least 2" in body["error"], body
    finally:
        server.stop()
        service.stop()


def test_unknown_states_are_refused(engines: list[Engine]) -> None:
    engines.append(Engine("pod-a"))
    service, server = serve(engines, [engines[0].pod_config()], FAST)
    try:
        answer = score(server, {"model": "m", "token_ids": [1] * BLOCK, "states": ["alive"]}, expect=400)
        assert answer["error"].startswith("states[0]: unknown state 'alive'"), answer
        answer = score(server, {"model": "m", "token_ids": [1] * BLOCK, "rank": "loudest"}, expect=400)
        assert answer["error"].startswith("rank"), answer
    finally:
        server.stop()
        service.stop()
