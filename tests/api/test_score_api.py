"""POST /v1/score against a real server and real engine event streams (ZMQ on 127.0.0.1).

Expected scores come from a brute-force reference of what each engine published (api_harness), and
LoRA / cache-salt / multimodal hashing from vLLM's own golden vectors.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from answer_paths import answer_writer  # noqa: F401  (a fixture)
from api_harness import ServerThread, reference_scores, start_service, wait_until_ingested
from engines import Engine
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.api.schemas import JSON_ENCODER
from kvindex.api.score import ALWAYS_REPORTED_TIERS
from kvindex.api.settings import ApiSettings
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.scorer import DEFAULT_TIER_WEIGHTS, score_prefix

# Every score request here runs through both answer writers (api/answer.py).
pytestmark = pytest.mark.usefixtures("answer_writer")

VECTORS = json.loads((Path(__file__).parent.parent / "vectors" / "hash-vectors.json").read_text())
BLOCK_SIZE = 16
MODEL = ModelConfig(name="m", block_size=BLOCK_SIZE, hash_algo="sha256", hash_seed="0")
UNKNOWN_WEIGHT = ApiSettings().unknown_tier_weight


async def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=body) as response:
            return response.status, await response.json()


async def get_json(url: str) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url) as response:
            return response.status, await response.json()


def score(server: ServerThread, body: dict[str, Any]) -> dict[str, Any]:
    status, payload = asyncio.run(post_json(server.url + "/v1/score", body))
    assert status == 200, payload
    return payload


class Fleet:
    """Three pods (one with two DP ranks) holding overlapping prefixes of a shared system prompt."""

    def __init__(self) -> None:
        rng = random.Random(20240611)
        hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed="0")
        self.system = [rng.randrange(0, 2**17) for _ in range(8 * BLOCK_SIZE)]
        self.prompt_a = self.system + [rng.randrange(0, 2**17) for _ in range(8 * BLOCK_SIZE + 5)]
        self.prompt_b = self.system + [rng.randrange(0, 2**17) for _ in range(4 * BLOCK_SIZE)]
        self.keys_a = hasher.event_hashes(self.prompt_a)
        self.keys_b = hasher.event_hashes(self.prompt_b)
        self.engines = [
            Engine("pod-a", model="m"),
            Engine("pod-b", model="m"),
            Engine("pod-c", model="m"),
            Engine("pod-c", model="m", dp_rank=1),
        ]

    def publish(self) -> None:
        pod_a, pod_b, pod_c0, pod_c1 = self.engines
        keys_a, keys_b, bs = self.keys_a, self.keys_b, BLOCK_SIZE
        # pod-a: all of prompt A on GPU, then evicts block 12 (its run on A stops at 12).
        pod_a.store_chain(keys_a, self.prompt_a, block_size=bs, start=0, stop=16)
        pod_a.remove([keys_a[12]])
        # pod-b: the system prompt on GPU, the rest of A offloaded to CPU; blocks 8..9 on both tiers.
        pod_b.store_chain(keys_a, self.prompt_a, block_size=bs, start=0, stop=10)
        pod_b.store_chain(keys_a, self.prompt_a, block_size=bs, start=8, stop=16, tier="CPU")
        # pod-c rank 0: prompt B fully, and A's tail without A's head (no leading run on A).
        pod_c0.store_chain(keys_b, self.prompt_b, block_size=bs, start=0, stop=12)
        pod_c0.store_chain(keys_a, self.prompt_a, block_size=bs, start=10, stop=16)
        # pod-c rank 1: the system prompt on an offload tier the weights do not list.
        pod_c1.store_chain(keys_b, self.prompt_b, block_size=bs, start=0, stop=6, tier="STORAGE")


@pytest.fixture(scope="module")
def fleet_server() -> Iterator[tuple[Fleet, IngestService, ServerThread]]:
    fleet = Fleet()
    service = start_service([MODEL], fleet.engines)
    server = ServerThread(service, ApiSettings(host="127.0.0.1", port=0)).start()
    try:
        fleet.publish()
        wait_until_ingested(service, fleet.engines)
        yield fleet, service, server
    finally:
        server.stop()
        service.stop()
        for engine in fleet.engines:
            engine.close()


def expected(fleet: Fleet, keys: list[int], pods: list[str] | None = None) -> list[dict[str, Any]]:
    return reference_scores(
        fleet.engines,
        keys,
        block_size=BLOCK_SIZE,
        tier_weights=DEFAULT_TIER_WEIGHTS,
        unknown_tier_weight=UNKNOWN_WEIGHT,
        pods=pods,
    )


def assert_scores(actual: list[dict[str, Any]], wanted: list[dict[str, Any]]) -> None:
    assert [(s["pod"], s["dp_rank"]) for s in actual] == [(s["pod"], s["dp_rank"]) for s in wanted]
    for got, want in zip(actual, wanted, strict=True):
        assert got["matched_blocks"] == want["matched_blocks"]
        assert got["matched_tokens"] == want["matched_tokens"]
        assert got["by_tier"] == want["by_tier"]
        assert got["score"] == pytest.approx(want["score"])


@pytest.mark.parametrize("prompt", ["a", "b", "system"])
def test_token_id_scores_match_the_reference(
    fleet_server: tuple[Fleet, IngestService, ServerThread], prompt: str
) -> None:
    fleet, _, server = fleet_server
    tokens = {"a": fleet.prompt_a, "b": fleet.prompt_b, "system": fleet.system}[prompt]
    keys = {"a": fleet.keys_a, "b": fleet.keys_b, "system": fleet.keys_a[:8]}[prompt]
    response = score(server, {"model": "m", "token_ids": tokens})
    assert response["model"] == "m"
    assert response["block_size"] == BLOCK_SIZE
    assert response["num_blocks"] == len(tokens) // BLOCK_SIZE  # the partial last block is not hashed
    wanted = expected(fleet, keys)
    assert wanted, "the fleet must hold something of every prompt"
    assert_scores(response["scores"], wanted)


def test_block_hash_input_scores_like_token_ids(
    fleet_server: tuple[Fleet, IngestService, ServerThread],
) -> None:
    fleet, _, server = fleet_server
    by_tokens = score(server, {"model": "m", "token_ids": fleet.prompt_a})
    by_hashes = score(server, {"block_hashes": fleet.keys_a})  # model omitted: the only one configured
    # Equal but for each pod's event age, which moves between the two requests.
    for answer in (by_hashes, by_tokens):
        for entry in answer["scores"]:
            assert entry.pop("last_event_age_s") >= 0 and entry["state"] == "live"
    assert by_hashes == by_tokens
    assert_scores(by_hashes["scores"], expected(fleet, fleet.keys_a))


@pytest.mark.parametrize("prompt", ["a", "b"])
def test_a_compact_answer_lists_the_reference_s_pods_in_brief(
    fleet_server: tuple[Fleet, IngestService, ServerThread], prompt: str
) -> None:
    fleet, _, server = fleet_server
    tokens, keys = (fleet.prompt_a, fleet.keys_a) if prompt == "a" else (fleet.prompt_b, fleet.keys_b)
    every_pod = ["pod-x", "pod-a", "pod-b", "pod-c"]
    response = score(server, {"model": "m", "token_ids": tokens, "answer": "compact", "pods": every_pod})
    assert set(response) == {"model", "block_size", "num_blocks", "scores", "unknown_pods"}
    assert (response["block_size"], response["unknown_pods"]) == (BLOCK_SIZE, ["pod-x"])
    wanted = expected(fleet, keys)
    assert [entry[:3] for entry in response["scores"]] == [
        [want["pod"], want["dp_rank"], want["matched_blocks"]] for want in wanted
    ]
    assert [entry[3] for entry in response["scores"]] == pytest.approx([want["score"] for want in wanted])
    nobody = score(server, {"model": "m", "block_hashes": [1, 2, 3], "answer": "compact"})
    assert nobody == {"model": "m", "block_size": BLOCK_SIZE, "num_blocks": 3, "scores": []}


def test_zero_runs_are_omitted_and_best_comes_first(
    fleet_server: tuple[Fleet, IngestService, ServerThread],
) -> None:
    fleet, _, server = fleet_server
    response = score(server, {"model": "m", "token_ids": fleet.prompt_a})
    assert all(s["matched_blocks"] > 0 for s in response["scores"])
    # From block 12 on: pod-a evicted block 12 (omitted although it holds 13..15), pod-c rank 1 never
    # held these blocks; pod-b (CPU) and pod-c rank 0 hold all four.
    tail = score(server, {"model": "m", "block_hashes": fleet.keys_a[12:16]})
    assert [(s["pod"], s["dp_rank"], s["matched_blocks"]) for s in tail["scores"]] == [
        ("pod-c", 0, 4),
        ("pod-b", 0, 4),
    ]
    assert [s["score"] for s in response["scores"]] == sorted(
        (s["score"] for s in response["scores"]), reverse=True
    )
    unknown = score(server, {"model": "m", "token_ids": list(range(1_000, 1_000 + 4 * BLOCK_SIZE))})
    assert unknown["scores"] == [] and unknown["num_blocks"] == 4


def test_tier_weights(fleet_server: tuple[Fleet, IngestService, ServerThread]) -> None:
    fleet, _, server = fleet_server
    response = score(server, {"model": "m", "token_ids": fleet.prompt_a})
    by_pod = {(s["pod"], s["dp_rank"]): s for s in response["scores"]}
    # pod-b: blocks 0..9 on GPU (8..9 also on CPU), 10..15 only on CPU: the GPU run alone is 10 long,
    # and no CPU run starts at block 0.
    assert by_pod[("pod-b", 0)]["matched_blocks"] == 16
    assert by_pod[("pod-b", 0)]["by_tier"] == {"GPU": 10, "CPU": 0}
    assert by_pod[("pod-b", 0)]["score"] == pytest.approx(10 * 1.0 + 6 * 0.8)
    # pod-a's 12 GPU blocks score 12.0; pod-b's longer, partly offloaded run scores 14.8 and ranks first.
    # pod-c's ranks hold only the shared system prompt: rank 0 on GPU (8.0), rank 1 on STORAGE (6 x 0.1).
    assert list(by_pod) == [("pod-b", 0), ("pod-a", 0), ("pod-c", 0), ("pod-c", 1)]
    storage = score(server, {"model": "m", "token_ids": fleet.prompt_b})
    rank1 = next(s for s in storage["scores"] if (s["pod"], s["dp_rank"]) == ("pod-c", 1))
    assert rank1["by_tier"] == {"GPU": 0, "CPU": 0, "STORAGE": 6}
    assert list(rank1["by_tier"]) == ["GPU", "CPU", "STORAGE"]  # the always-present tiers first
    assert rank1["score"] == pytest.approx(6 * UNKNOWN_WEIGHT)


def test_pod_filter(fleet_server: tuple[Fleet, IngestService, ServerThread]) -> None:
    fleet, _, server = fleet_server
    response = score(server, {"model": "m", "token_ids": fleet.prompt_b, "pods": ["pod-c"]})
    assert_scores(response["scores"], expected(fleet, fleet.keys_b, pods=["pod-c"]))
    assert {s["pod"] for s in response["scores"]} == {"pod-c"}
    assert len(response["scores"]) == 2  # both DP ranks of pod-c
    nobody = score(server, {"model": "m", "token_ids": fleet.prompt_b, "pods": ["no-such-pod"]})
    assert nobody["scores"] == []


def test_pods_health_and_readiness(fleet_server: tuple[Fleet, IngestService, ServerThread]) -> None:
    fleet, _, server = fleet_server
    status, pods = asyncio.run(get_json(server.url + "/v1/pods"))
    assert status == 200
    rows = {(p["pod"], p["dp_rank"]): p for p in pods["pods"]}
    assert set(rows) == {(e.pod_id, e.dp_rank) for e in fleet.engines}
    for engine in fleet.engines:
        row = rows[(engine.pod_id, engine.dp_rank)]
        assert row["model"] == "m"
        assert row["endpoint"] == engine.publisher.endpoint
        assert row["state"] == "live"
        assert row["last_seq"] == engine.publisher.last_seq
        for key in (
            "last_event_age_s",
            "events_total",
            "gaps_total",
            "replays_total",
            "blocks",
            "hash_mismatches_total",
        ):
            assert key in row
    assert rows[("pod-a", 0)]["blocks"] == 15  # 16 stored, 1 removed
    assert asyncio.run(get_json(server.url + "/healthz"))[0] == 200
    assert asyncio.run(get_json(server.url + "/readyz")) == (200, {"ready": True, "live_pods": 4})


def test_ingest_counters_count_what_the_fleet_published(
    fleet_server: tuple[Fleet, IngestService, ServerThread],
) -> None:
    """GET /v1/ingest: Fleet.publish sent six BlockStored (pod-a 1, pod-b 2, pod-c 2 + 1) and one
    BlockRemoved, all applied; nothing dropped, no gap."""
    _, _, server = fleet_server
    status, counters = asyncio.run(get_json(server.url + "/v1/ingest"))
    assert status == 200
    assert counters["events_applied"] == {"BlockStored": 6, "BlockRemoved": 1}
    assert (counters["dropped"], counters["gaps"], counters["restarts"]) == ({}, 0, 0)
    _, pods = asyncio.run(get_json(server.url + "/v1/pods"))
    assert sum(pod["events_total"] for pod in pods["pods"]) == 7


# --- LoRA, cache salt and multimodal requests hash exactly like vLLM (golden vectors) ----------------

EXTRA_KEY_CASES = [
    case
    for case in VECTORS["cases"]
    if any(k in case for k in ("lora", "cache_salt", "mm"))
    and (case["seed"] in ("0", None))
    and "lookahead" not in case
]
VECTOR_MODELS = sorted({(c["algo"], c["seed"], c["block_size"]) for c in EXTRA_KEY_CASES}, key=str)


def vector_model_name(algo: str, seed: str | None, block_size: int) -> str:
    return f"{algo}-seed{seed}-bs{block_size}"


@pytest.fixture(scope="module")
def vector_server() -> Iterator[tuple[dict[str, Engine], ServerThread]]:
    models = [
        ModelConfig(
            name=vector_model_name(algo, seed, bs),
            block_size=bs,
            hash_algo=algo,
            hash_seed=seed,
            lora_adapters={"sql-lora": "/adapters/sql-lora"},
        )
        for algo, seed, bs in VECTOR_MODELS
    ]
    engines = {m.name: Engine(f"pod-{m.name}", model=m.name) for m in models}
    service = start_service(models, list(engines.values()))
    server = ServerThread(service).start()
    try:
        for case in EXTRA_KEY_CASES:
            engine = engines[vector_model_name(case["algo"], case["seed"], case["block_size"])]
            tokens = VECTORS["prompts"][case["prompt"]]
            event_hashes = case["expected"]["event_hashes"]
            bs = case["block_size"]
            engine.store(
                event_hashes,
                tokens[: len(event_hashes) * bs],
                block_size=bs,
                lora_name=case["lora"]["name"] if "lora" in case else None,
                extra_keys=case["expected"]["event_extra_keys"],
            )
        wait_until_ingested(service, list(engines.values()))
        yield engines, server
    finally:
        server.stop()
        service.stop()
        for engine in engines.values():
            engine.close()


@pytest.mark.parametrize("case", EXTRA_KEY_CASES, ids=[c["id"] for c in EXTRA_KEY_CASES])
def test_extra_key_requests_hash_like_vllm(
    vector_server: tuple[dict[str, Engine], ServerThread], case: dict[str, Any]
) -> None:
    engines, server = vector_server
    model = vector_model_name(case["algo"], case["seed"], case["block_size"])
    body: dict[str, Any] = {"model": model, "token_ids": VECTORS["prompts"][case["prompt"]]}
    if "lora" in case:
        body["lora_name"] = case["lora"]["name"]
        body["lora_path"] = case["lora"]["path"]
    if "cache_salt" in case:
        body["cache_salt"] = case["cache_salt"]
    if "mm" in case:
        body["mm"] = case["mm"]
    response = score(server, body)
    num_blocks = len(case["expected"]["event_hashes"])
    assert response["num_blocks"] == num_blocks
    assert [(s["pod"], s["matched_blocks"]) for s in response["scores"]] == [
        (engines[model].pod_id, num_blocks)
    ]


def test_lora_name_alone_uses_the_models_adapter_table(
    vector_server: tuple[dict[str, Engine], ServerThread],
) -> None:
    _, server = vector_server
    (case,) = [c for c in EXTRA_KEY_CASES if c["id"] == "sha256/seed=0/lora"]
    assert case["lora"]["path"] == "/adapters/sql-lora"  # the path in the model's lora_adapters table
    model = vector_model_name("sha256", "0", 16)
    tokens = VECTORS["prompts"][case["prompt"]]
    by_name = score(server, {"model": model, "token_ids": tokens, "lora_name": "sql-lora"})
    assert [s["matched_blocks"] for s in by_name["scores"]] == [3]
    # The adapter's path is part of the hash: without LoRA the same tokens match nothing the pod holds.
    plain = score(server, {"model": model, "token_ids": tokens})
    assert plain["scores"] == []


# --- the response rows without HTTP: every holder shape, against CONTRACT.md by brute force ----------
# The scorer has a fast path (every holder a different pod, one tier each) and a general one (a pod on
# several tiers or ranks); both must give the contract's rows, with GPU and CPU always in by_tier.

# Powers of two, so sums are exact and ties are real ties; the second set ties every tier.
EXACT_WEIGHT_SETS = [({"GPU": 1.0, "CPU": 0.5}, 0.125), ({"GPU": 0.5, "CPU": 0.5}, 0.5)]
HOLDINGS = st.dictionaries(
    st.builds(PodRef, st.sampled_from("abcd"), st.integers(0, 1)),
    st.dictionaries(
        st.sampled_from(("GPU", "CPU", "STORAGE")), st.sets(st.integers(0, 9), max_size=10), max_size=3
    ),
    max_size=6,
)


def contract_rows(
    holdings: dict[PodRef, dict[str, set[int]]], prompt: list[int], weights: dict[str, float], unknown: float
) -> list[dict[str, Any]]:
    rows = []
    for pod, tiers in holdings.items():
        run, weight_sum = 0, 0.0
        while run < len(prompt) and any(prompt[run] in keys for keys in tiers.values()):
            weight_sum += max(weights.get(t, unknown) for t, keys in tiers.items() if prompt[run] in keys)
            run += 1
        tier_runs = {}
        for tier, keys in tiers.items():
            tier_run = 0
            while tier_run < len(prompt) and prompt[tier_run] in keys:
                tier_run += 1
            tier_runs[tier] = tier_run
        by_tier = {"GPU": tier_runs.get("GPU", 0), "CPU": tier_runs.get("CPU", 0)}
        by_tier |= {t: r for t, r in sorted(tier_runs.items()) if r and t not in by_tier}
        if run:
            row = {"pod": pod.pod_id, "dp_rank": pod.dp_rank, "matched_blocks": run}
            rows.append(row | {"matched_tokens": run * 4, "score": weight_sum, "by_tier": by_tier})
            # No stream feeds this directly filled index: the entries are taken as live, age unknown.
            rows[-1] |= {"state": "live", "last_event_age_s": None}
    rows.sort(key=lambda r: (-r["score"], -r["matched_blocks"], r["pod"], r["dp_rank"]))
    return rows


@settings(max_examples=300, deadline=None)
@given(
    holdings=HOLDINGS,
    prompt=st.lists(st.integers(0, 9), max_size=10, unique=True),
    weight_set=st.sampled_from(EXACT_WEIGHT_SETS),
)
def test_response_rows_match_the_contract(
    holdings: dict[PodRef, dict[str, set[int]]], prompt: list[int], weight_set: tuple[dict[str, float], float]
) -> None:
    weights, unknown = weight_set
    index = KVIndex(num_shards=2)
    for pod, tiers in holdings.items():
        for tier, keys in tiers.items():
            stored = BlocksStored(
                block_keys=tuple(sorted(keys)), parent_key=None, token_ids=(), block_size=4, tier=tier
            )
            index.apply(pod, [stored])
    scores = score_prefix(
        index,
        prompt,
        block_size=4,
        tier_weights=weights,
        unknown_tier_weight=unknown,
        report_tiers=ALWAYS_REPORTED_TIERS,
    )
    encoded = json.loads(JSON_ENCODER.encode(scores))
    assert encoded == contract_rows(holdings, prompt, weights, unknown)
    assert all(list(row["by_tier"])[:2] == ["GPU", "CPU"] for row in encoded)
