"""A token prompt is hashed only up to soon after the first block no pod holds (api/score.prompt_holders),
and the answer is still the whole prompt's: against a real server and engines (expected scores from the
brute-force reference in api_harness), and against a real index that a batch changes between the
question and the lookup."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest
from api_harness import ServerThread, reference_scores, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.score import prompt_holders
from kvindex.api.settings import ApiSettings
from kvindex.hashing import BlockHasher, HeldCheck
from kvindex.indexer.events import BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.scorer import DEFAULT_TIER_WEIGHTS
from prompt_metrics import prompt_block_counts
from test_score_api import post_json

BLOCK_SIZE = 16
MODEL = ModelConfig(name="m", block_size=BLOCK_SIZE, hash_algo="sha256", hash_seed="0")
HASHER = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed="0")
RNG = random.Random(1103)
# 150 blocks and a partial one; a second prompt shares its first 40 blocks, then goes on for 960 more.
PROMPT = [RNG.randrange(0, 2**17) for _ in range(150 * BLOCK_SIZE + 7)]
KEYS = HASHER.event_hashes(PROMPT)
FORK = PROMPT[: 40 * BLOCK_SIZE] + [RNG.randrange(0, 2**17) for _ in range(960 * BLOCK_SIZE)]
FORK_KEYS = HASHER.event_hashes(FORK)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[list[Engine], Any]]:
    # pod-long: blocks 0..39 and 64..149 (a hole at 40..63); pod-head: blocks 0..19; pod-tail: 100..149.
    long, head, tail = (
        Engine("pod-long", model="m"),
        Engine("pod-head", model="m"),
        Engine("pod-tail", model="m"),
    )
    service = start_service([MODEL], [long, head, tail])
    try:
        long.store_chain(KEYS, PROMPT, block_size=BLOCK_SIZE, start=0, stop=40)
        long.store_chain(KEYS, PROMPT, block_size=BLOCK_SIZE, start=64, stop=150)
        head.store_chain(KEYS, PROMPT, block_size=BLOCK_SIZE, start=0, stop=20)
        tail.store_chain(KEYS, PROMPT, block_size=BLOCK_SIZE, start=100, stop=150)
        wait_until_ingested(service, [long, head, tail])
        yield [long, head, tail], service
    finally:
        service.stop()
        for engine in (long, head, tail):
            engine.close()


# The event loop's hasher (default threshold), the hashing thread's (every prompt of 1,000+ tokens), and
# aiohttp's handler instead of the fast path.
SERVER_KINDS = {
    "loop": ({}, True),
    "thread": ({"hash_in_executor_min_tokens": 1_000}, True),
    "aiohttp": ({}, False),
}


@pytest.fixture(scope="module", params=list(SERVER_KINDS))
def server(request: pytest.FixtureRequest, engines: tuple[list[Engine], Any]) -> Iterator[ServerThread]:
    options, fast_score = SERVER_KINDS[request.param]
    settings = ApiSettings(host="127.0.0.1", port=0, **options)
    thread = ServerThread(engines[1], settings, fast_score=fast_score).start()
    try:
        yield thread
    finally:
        thread.stop()


def expected(engines: list[Engine], keys: list[int], pods: list[str] | None = None) -> list[list[Any]]:
    wanted = reference_scores(
        engines,
        keys,
        block_size=BLOCK_SIZE,
        tier_weights=DEFAULT_TIER_WEIGHTS,
        unknown_tier_weight=ApiSettings().unknown_tier_weight,
        pods=pods,
    )
    return [[w["pod"], w["dp_rank"], w["matched_blocks"], w["score"]] for w in wanted]


@pytest.mark.parametrize(
    ("tokens", "keys", "pods"),
    [
        (PROMPT, KEYS, None),
        (FORK, FORK_KEYS, None),
        (PROMPT, KEYS, ["pod-head"]),
        (PROMPT, KEYS, ["pod-tail"]),
        (PROMPT[40 * BLOCK_SIZE :], KEYS[40:], None),  # a prompt nobody holds the first block of
    ],
    ids=["held-past-a-hole", "fork-after-40", "only-pod-head", "only-pod-tail", "nobody"],
)
def test_the_answer_is_the_whole_prompt_s(
    engines: tuple[list[Engine], Any],
    server: ServerThread,
    tokens: list[int],
    keys: list[int],
    pods: list[str] | None,
) -> None:
    body: dict[str, Any] = {"model": "m", "token_ids": tokens, "answer": "compact"}
    if pods is not None:
        body["pods"] = pods
    if tokens is not PROMPT and tokens is not FORK:
        keys = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed="0").event_hashes(tokens)
    status, answer = asyncio.run(post_json(server.url + "/v1/score", body))
    assert status == 200, answer
    assert answer["num_blocks"] == len(tokens) // BLOCK_SIZE  # every block counted, hashed or not
    # Weights of 1.0 (GPU) only: every score is an exact sum.
    assert answer["scores"] == expected(engines[0], keys, pods)


def test_a_block_stored_between_the_question_and_the_lookup_is_seen() -> None:
    """The question says no pod holds block 31; a batch storing blocks 20..149 for pod-b lands before the
    lookup: the answer runs on past block 31, as a lookup over the whole prompt would then."""
    index = KVIndex()
    pod_a, pod_b = PodRef("pod-a"), PodRef("pod-b")
    index.apply(
        pod_a, [BlocksStored(block_keys=tuple(KEYS[:20]), parent_key=None, token_ids=(), block_size=16)]
    )
    index.apply(
        pod_b, [BlocksStored(block_keys=tuple(KEYS[:20]), parent_key=None, token_ids=(), block_size=16)]
    )
    hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed="0")
    asked: list[bool] = []

    def hash_prompt(held: HeldCheck | None) -> list[int]:
        keys = hasher.event_hashes(PROMPT, held=held)
        if held is not None:
            asked.append(True)
            assert len(keys) < len(KEYS)  # it did stop early
            rest = BlocksStored(block_keys=tuple(KEYS[20:]), parent_key=KEYS[19], token_ids=(), block_size=16)
            index.apply(pod_b, [rest])
        return keys

    holder_ids, hashed_blocks = prompt_holders(index, hash_prompt, len(KEYS), None)
    assert asked == [True]
    assert holder_ids == index.lookup_ids(KEYS)
    assert len(holder_ids) == hashed_blocks == len(KEYS)


def test_a_block_stored_between_the_question_and_the_lookup_that_leaves_a_hole_is_exact() -> None:
    """The batch stores the block asked about, but a block before it stays unheld: one lookup answers."""
    index = KVIndex()
    pod = PodRef("pod-a")
    index.apply(
        pod, [BlocksStored(block_keys=tuple(KEYS[:10]), parent_key=None, token_ids=(), block_size=16)]
    )
    hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed="0")

    def hash_prompt(held: HeldCheck | None) -> list[int]:
        keys = hasher.event_hashes(PROMPT, held=held)
        assert held is not None, "no second hashing: the lookup stopped inside what was hashed"
        late = BlocksStored(block_keys=tuple(KEYS[12:]), parent_key=KEYS[11], token_ids=(), block_size=16)
        index.apply(pod, [late])
        return keys

    holder_ids, hashed_blocks = prompt_holders(index, hash_prompt, len(KEYS), None)
    assert holder_ids == index.lookup_ids(KEYS)
    assert len(holder_ids) == 10
    assert 10 < hashed_blocks < len(KEYS)


def test_prompt_blocks_are_counted_hashed_or_not(server: ServerThread) -> None:
    before = prompt_block_counts(server.url)
    # FORK: 1,000 blocks, held to block 39 (pod-long): hashed past 39, far from all of them.
    assert asyncio.run(post_json(server.url + "/v1/score", {"model": "m", "token_ids": FORK}))[0] == 200
    middle = prompt_block_counts(server.url)
    hashed = middle.get("true", 0) - before.get("true", 0)
    unhashed = middle.get("false", 0) - before.get("false", 0)
    assert hashed + unhashed == len(FORK) // BLOCK_SIZE
    assert 40 < hashed < 200 and unhashed > 800
    # Blocks 0..19 are held (pod-long and pod-head): every block is hashed; block hashes are not counted.
    head = {"model": "m", "token_ids": PROMPT[: 20 * BLOCK_SIZE]}
    assert asyncio.run(post_json(server.url + "/v1/score", head))[0] == 200
    assert asyncio.run(post_json(server.url + "/v1/score", {"model": "m", "block_hashes": KEYS}))[0] == 200
    after = prompt_block_counts(server.url)
    assert after.get("true", 0) - middle.get("true", 0) == 20
    assert after.get("false", 0) == middle.get("false", 0)
