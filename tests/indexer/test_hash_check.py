"""The ingest-side hash agreement check against vLLM's own hashes (tests/vectors/hash-vectors.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import BlocksStored
from kvindex.indexer.hash_check import (
    ALWAYS_CHECK_FIRST,
    HashCheckSampler,
    diagnose_mismatch,
    hashes_agree,
    is_checkable,
)
from kvindex.indexer.model import ModelConfig

VECTORS = json.loads((Path(__file__).parent.parent / "vectors" / "hash-vectors.json").read_text())


def stored_event(algo: str, seed: str | None, prompt: str = "p1000", block_size: int = 16) -> BlocksStored:
    """A BlocksStored as a vLLM engine with these settings publishes it (keys from vLLM's vectors)."""
    case = next(
        c
        for c in VECTORS["cases"]
        if c["algo"] == algo
        and c["seed"] == seed
        and c["block_size"] == block_size
        and c["prompt"] == prompt
        and not any(k in c for k in ("lora", "mm", "cache_salt", "lookahead", "prompt_embeds_digests_hex"))
    )
    keys = case["expected"]["event_hashes"]
    tokens = VECTORS["prompts"][prompt][: len(keys) * block_size]
    return BlocksStored(
        block_keys=tuple(keys),
        parent_key=None,
        token_ids=tuple(tokens),
        block_size=block_size,
        extra_keys=(None,) * len(keys),
    )


def hasher_for(config: ModelConfig) -> BlockHasher:
    return BlockHasher(algo=config.hash_algo, block_size=config.block_size, seed=config.hash_seed)


@pytest.mark.parametrize(
    ("algo", "seed"), [("sha256", None), ("sha256", "0"), ("sha256_cbor", "42"), ("xxhash", "0")]
)
def test_matching_settings_agree(algo: str, seed: str | None) -> None:
    config = ModelConfig(name="m", hash_algo=algo, hash_seed=seed)
    event = stored_event(algo, seed)
    assert is_checkable(event, config.block_size)
    assert hashes_agree(event, hasher_for(config))


def test_other_seed_is_named() -> None:
    config = ModelConfig(name="m", hash_algo="sha256", hash_seed="42")
    event = stored_event("sha256", "0")
    assert not hashes_agree(event, hasher_for(config))
    assert "hash_seed='0' (configured '42')" in diagnose_mismatch(event, config)


def test_unset_seed_is_named() -> None:
    config = ModelConfig(name="m", hash_algo="sha256", hash_seed="0")
    event = stored_event("sha256", None)
    assert "hash_seed=unset" in diagnose_mismatch(event, config)


def test_other_algorithm_is_named() -> None:
    config = ModelConfig(name="m", hash_algo="sha256", hash_seed="0")
    event = stored_event("sha256_cbor", "0")
    assert not hashes_agree(event, hasher_for(config))
    message = diagnose_mismatch(event, config)
    assert "hash_algo=sha256_cbor" in message and "hash_seed" not in message


def test_event_block_size_is_named() -> None:
    config = ModelConfig(name="m", hash_algo="sha256", hash_seed="0", block_size=16)
    event = stored_event("sha256", "0", block_size=64)
    assert not is_checkable(event, config.block_size)
    assert "block_size=64 (configured 16)" in diagnose_mismatch(event, config)


def test_seed_nobody_guesses_points_at_pythonhashseed() -> None:
    config = ModelConfig(name="m", hash_algo="sha256", hash_seed="42")
    event = stored_event("sha256", "1234567")
    assert "unknown seed (check PYTHONHASHSEED" in diagnose_mismatch(event, config)


def test_events_that_cannot_be_recomputed_are_not_checked() -> None:
    event = stored_event("sha256", "0")
    assert not is_checkable(msgspec_replace(event, parent_key=123), 16)
    assert not is_checkable(msgspec_replace(event, extra_keys=("lora-a",) + (None,) * 61), 16)
    assert not is_checkable(msgspec_replace(event, token_ids=event.token_ids + (1,)), 16)  # skipped blocks
    assert not is_checkable(msgspec_replace(event, lora_name="a"), 16)
    placeholder = BlocksStored(block_keys=(5,), parent_key=None, token_ids=(), block_size=0)
    assert not is_checkable(placeholder, 16)


def msgspec_replace(event: BlocksStored, **changes: object) -> BlocksStored:
    return msgspec.structs.replace(event, **changes)


def test_sampler_checks_the_first_few_then_one_in_every() -> None:
    sampler = HashCheckSampler(every=10)
    decisions = [sampler.should_check("pod-a") for _ in range(ALWAYS_CHECK_FIRST + 30)]
    assert decisions[:ALWAYS_CHECK_FIRST] == [True] * ALWAYS_CHECK_FIRST
    assert sum(decisions[ALWAYS_CHECK_FIRST:]) == 3
    assert sampler.should_check("pod-b")  # per stream
