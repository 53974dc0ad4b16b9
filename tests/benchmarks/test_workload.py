"""The benchmark workload: its hashes are vLLM's (golden vectors) and its expectations follow the rules."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from kvindex.replay.wire import KVEventBatch

from benchmarks.workload import (
    WorkloadSpec,
    build_workload,
    encode_engine,
    event_hash,
    pickle_sha256_digests,
)

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "hash-vectors.json"
SMALL = WorkloadSpec(num_engines=3, blocks_per_engine=700, num_prefixes=2, num_queries=12, seed=5)


def _plain_sha256_cases() -> list[dict[str, object]]:
    data = json.loads(VECTORS.read_text())
    cases = [
        case
        for case in data["cases"]
        if case["algo"] == "sha256"
        and case["seed"] is not None
        and not ({"lora", "cache_salt", "mm", "lookahead", "prompt_embeds_digests_hex"} & case.keys())
    ]
    for case in cases:
        case["token_ids"] = data["prompts"][case["prompt"]]
    return cases


@pytest.mark.parametrize("case", _plain_sha256_cases(), ids=lambda case: str(case["id"]))
def test_pickle_digests_match_vllm_vectors(case: dict[str, object]) -> None:
    expected = case["expected"]
    assert isinstance(expected, dict)
    token_ids = case["token_ids"]
    assert isinstance(token_ids, list)
    digests = pickle_sha256_digests(token_ids, int(str(case["block_size"])), str(case["seed"]))
    assert [d.hex() for d in digests] == expected["block_hashes_hex"]
    assert [event_hash(d) for d in digests] == expected["event_hashes"]


def test_workload_is_deterministic_and_sized() -> None:
    first, second = build_workload(SMALL), build_workload(SMALL)
    assert [encode_engine(e) for e in first.engines] == [encode_engine(e) for e in second.engines]
    assert [q.token_ids for q in first.queries] == [q.token_ids for q in second.queries]
    for engine in first.engines:
        stored = [h for events in engine.messages for event in events for h in event.block_hashes]
        assert len(stored) == len(set(stored)) == SMALL.blocks_per_engine
        assert all(len(events) <= SMALL.events_per_message for events in engine.messages)
        assert all(
            len(event.block_hashes) <= SMALL.blocks_per_event
            for events in engine.messages
            for event in events
        )


def test_events_chain_and_carry_their_tokens() -> None:
    """Replaying an engine's events from the rules rebuilds hashes equal to hashing its token runs."""
    workload = build_workload(SMALL)
    for engine in workload.engines:
        hash_to_tokens: dict[int, list[int]] = {}
        parent_of: dict[int, int | None] = {}
        for events in engine.messages:
            for event in events:
                assert len(event.token_ids) == len(event.block_hashes) * SMALL.block_size
                assert event.parent_block_hash is None or event.parent_block_hash in hash_to_tokens
                previous = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    assert isinstance(block_hash, int)
                    hash_to_tokens[block_hash] = event.token_ids[i * 16 : (i + 1) * 16]
                    parent_of[block_hash] = previous
                    previous = block_hash
        for block_hash in list(hash_to_tokens)[::97]:
            chain: list[int] = []
            cursor: int | None = block_hash
            while cursor is not None:
                chain[:0] = hash_to_tokens[cursor]
                cursor = parent_of[cursor]
            digests = pickle_sha256_digests(chain, SMALL.block_size, SMALL.hash_seed)
            assert event_hash(digests[-1]) == block_hash


def test_query_expectations_follow_stored_sets() -> None:
    workload = build_workload(SMALL)
    for query in workload.queries:
        assert len(query.token_ids) == SMALL.query_blocks * SMALL.block_size
        assert [
            event_hash(d) for d in pickle_sha256_digests(query.token_ids, 16, SMALL.hash_seed)
        ] == query.event_hashes
        for engine in workload.engines:
            matched = query.expected_blocks.get(engine.engine_index, 0)
            assert all(h in engine.stored_event_hashes for h in query.event_hashes[:matched])
            assert (
                matched == len(query.event_hashes)
                or query.event_hashes[matched] not in engine.stored_event_hashes
            )
    assert any(max(q.expected_blocks.values(), default=0) > SMALL.prefix_blocks for q in workload.queries)


def test_payload_is_a_vllm_batch() -> None:
    engine = build_workload(SMALL).engines[0]
    payload = encode_engine(engine)[0]
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert batch.events == engine.messages[0]
    assert msgspec.msgpack.decode(payload)[1][0]["type"] == "BlockStored"  # map-form events, as vLLM 0.33
