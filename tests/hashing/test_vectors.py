"""BlockHasher against every golden vector vLLM 0.33.0 computed (tests/vectors/)."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from kvindex.hashing import BlockHasher, HashingError, MMItem, event_hash, hybrid_block_hashes

# Every test here runs with both hash cores: compiled and pure Python (tests/hashing/conftest.py).
pytestmark = pytest.mark.usefixtures("hash_core")

VECTORS_DIR = Path(__file__).resolve().parent.parent / "vectors"
_VECTORS = json.loads((VECTORS_DIR / "hash-vectors.json").read_text(encoding="utf-8"))
_RAW = json.loads((VECTORS_DIR / "vllm-0.33.0-raw-vectors.json").read_text(encoding="utf-8"))
_CASES = {case["id"]: case for case in _VECTORS["cases"]}


def _keywords(case: dict[str, Any]) -> dict[str, Any]:
    keywords: dict[str, Any] = {}
    if "lora" in case:
        keywords.update(lora_name=case["lora"]["name"], lora_path=case["lora"]["path"])
    if "cache_salt" in case:
        keywords["cache_salt"] = case["cache_salt"]
    if "mm" in case:
        keywords["mm"] = [MMItem(**item) for item in case["mm"]]
    if "lookahead" in case:
        keywords["lookahead"] = case["lookahead"]
    if "prompt_embeds_digests_hex" in case:
        keywords["prompt_embeds_digests"] = [bytes.fromhex(d) for d in case["prompt_embeds_digests_hex"]]
    return keywords


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    return value


def test_the_file_holds_all_327_cases() -> None:
    assert len(_CASES) == 327


@pytest.mark.parametrize("case_id", sorted(_CASES))
@pytest.mark.parametrize("memo_size", [0, 4096])
def test_case(case_id: str, memo_size: int) -> None:
    case = _CASES[case_id]
    expected = case["expected"]
    tokens = _VECTORS["prompts"][case["prompt"]]
    keywords = _keywords(case)
    hasher = BlockHasher(
        algo=case["algo"], block_size=case["block_size"], seed=case["seed"], memo_size=memo_size
    )
    assert hasher.root.hex() == expected["root_hex"]
    for _ in range(2):  # the second pass is served by the memo when it is on
        assert [d.hex() for d in hasher.block_hashes(tokens, **keywords)] == expected["block_hashes_hex"]
        assert hasher.event_hashes(tokens, **keywords) == expected["event_hashes"]
        assert hasher.event_key_array(tokens, **keywords).tolist() == expected["event_hashes"]
    extra_keys = _jsonable(hasher.event_extra_keys(tokens, **keywords))
    if expected["event_extra_keys"] is None:
        # The file writes null for the lookahead cases; vLLM's BlockPool publishes one null per block there.
        assert extra_keys == [None] * len(expected["block_hashes_hex"])
    else:
        assert extra_keys == expected["event_extra_keys"]


@pytest.mark.parametrize("case_id", sorted(_CASES))
def test_case_from_packed_ids(case_id: str) -> None:
    """The score API's compiled reader hands the hasher an array('I'): the same digests, memo or not."""
    case = _CASES[case_id]
    tokens = _VECTORS["prompts"][case["prompt"]]
    if any(token >= 2**32 for token in tokens):
        pytest.skip("ids of 2**32 or more never come packed")
    expected = case["expected"]
    keywords = _keywords(case)
    for memo_size in (0, 4096):
        hasher = BlockHasher(
            algo=case["algo"], block_size=case["block_size"], seed=case["seed"], memo_size=memo_size
        )
        for _ in range(2):
            packed = array("I", tokens)
            assert [d.hex() for d in hasher.block_hashes(packed, **keywords)] == expected["block_hashes_hex"]
            assert hasher.event_hashes(packed, **keywords) == expected["event_hashes"]
            assert hasher.event_key_array(packed, **keywords).tolist() == expected["event_hashes"]
            assert hasher.event_hashes(tokens, **keywords) == expected["event_hashes"]  # shares the memo


def test_raw_extra_key_cases_event_keys_match_blockpool_shape() -> None:
    """The raw generator output (vLLM's to_event_extra_keys per block) for every extra-key case."""
    checked = 0
    for raw in _RAW["extra_key_cases"]:
        case = _CASES.get(raw["id"])
        if case is None:
            continue  # a raw case the curated file does not carry (its inputs are only described in prose)
        checked += 1
        hasher = BlockHasher(algo=case["algo"], block_size=case["block_size"], seed=case["seed"], memo_size=0)
        tokens = _VECTORS["prompts"][case["prompt"]]
        assert _jsonable(hasher.event_extra_keys(tokens, **_keywords(case))) == raw["event_extra_keys"], raw[
            "id"
        ]
    assert checked == 68  # every raw case that the curated file also carries


@pytest.mark.parametrize("seed", ["0", "42", "1234567"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_roots(seed: str, algo: str) -> None:
    expected = _RAW["roots"][seed][algo]
    root = BlockHasher(algo=algo, seed=seed).root
    assert root.hex() == expected["NONE_HASH_hex"]
    assert event_hash(root) == expected["NONE_HASH_event_value"]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_unset_seed_root_is_vllms_fixed_one(algo: str) -> None:
    summary = _RAW["unset_pythonhashseed"]["summary"][algo]
    assert summary["identical_across_processes"]
    assert BlockHasher(algo=algo, seed=None).root.hex() == summary["run0_NONE_HASH"]


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_unset_seed_is_refused_for_xxhash(algo: str) -> None:
    summary = _RAW["unset_pythonhashseed"]["summary"][algo]
    assert summary["run0_NONE_HASH"] != summary["run1_NONE_HASH"]  # vLLM's root really is random
    with pytest.raises(HashingError, match="PYTHONHASHSEED"):
        BlockHasher(algo=algo, seed=None)


@pytest.mark.parametrize("index", range(len(_RAW["hybrid_granularity_cases"])))
def test_hybrid_granularity(index: int) -> None:
    case = _RAW["hybrid_granularity_cases"][index]
    fine = [bytes.fromhex(h) for h in case["block_hashes_16_hex"]]
    coarse = hybrid_block_hashes(fine, case["hash_block_size"], case["group_block_size"])
    assert [h.hex() for h in coarse] == case["group64_block_hashes_hex"]
    # and the fine-grained list itself is what we compute from the prompt
    tokens = _RAW["prompts"][str(case["prompt_len"])]
    ours = BlockHasher(algo=case["algo"], block_size=case["hash_block_size"], seed="0").block_hashes(tokens)
    assert [h.hex() for h in ours] == case["block_hashes_16_hex"]


def test_hybrid_granularity_refuses_a_non_multiple() -> None:
    with pytest.raises(HashingError, match="multiple"):
        hybrid_block_hashes([b"x"] * 8, 16, 24)
