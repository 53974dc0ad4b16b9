"""Property tests: BlockHasher (fast CBOR encoder, memo) against a reference written from vLLM's rules.

The reference is the plain formula vLLM runs per block — H(pickle.dumps / cbor2.dumps(canonical) of
(parent or NONE_HASH, tuple(block tokens), extra keys)) — with extra keys built by brute force from the
rules in spec §4.4 (every MM item overlapping the block, offset relative to the block start).
"""

from __future__ import annotations

import threading
from array import array
from typing import Any

import cbor2
import pytest
from hash_cores import EDGE_IDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvindex.hashing import HASH_ALGOS, BlockHasher, HashingError, MMItem, event_hash
from kvindex.hashing.cbor_fast import array_head, encode_tokens
from reference import mm_items, reference_chain, reference_extra_keys

# Every test here runs with both hash cores: compiled and pure Python (tests/hashing/conftest.py).
pytestmark = pytest.mark.usefixtures("hash_core")

EDGE_INTS = [*EDGE_IDS, 2**64, 2**70]  # and ids past 2**64, which only the pure path serialises
token_id = st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, 2**18), st.integers(0, 2**80))
token_lists = st.lists(token_id, max_size=120)
algos = st.sampled_from(HASH_ALGOS)
block_sizes = st.sampled_from([1, 2, 3, 16, 23, 24, 25])
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast
@given(tokens=token_lists, algo=algos, block_size=block_sizes, seed=st.sampled_from(["0", "42", "abc"]))
def test_equals_the_reference_formula(tokens: list[int], algo: str, block_size: int, seed: str) -> None:
    expected = reference_chain(algo, seed, block_size, tokens)
    hasher = BlockHasher(algo=algo, block_size=block_size, seed=seed)
    assert hasher.block_hashes(tokens) == expected
    assert hasher.block_hashes(tuple(tokens)) == expected  # second call: served by the memo
    assert hasher.event_hashes(tokens) == [int.from_bytes(d, "big") & (2**64 - 1) for d in expected]
    keys = hasher.event_key_array(tokens)
    assert keys.typecode == "Q" and keys.tolist() == [
        int.from_bytes(d, "big") & (2**64 - 1) for d in expected
    ]
    assert (
        BlockHasher(algo=algo, block_size=block_size, seed=seed, memo_size=0).block_hashes(tokens) == expected
    )


@fast
@given(tokens=token_lists)
def test_fast_cbor_token_encoding_is_cbor2s(tokens: list[int]) -> None:
    assert array_head(len(tokens)) + b"".join(encode_tokens(tuple(tokens))) == cbor2.dumps(
        tokens, canonical=True
    )
    for token in tokens:
        assert encode_tokens((token,)) == (cbor2.dumps(token, canonical=True),)


@fast
@given(
    data=st.data(),
    algo=algos,
    block_size=st.sampled_from([1, 4, 16]),
    lookahead=st.sampled_from([0, 0, 1, 2]),
)
def test_extra_keys_equal_the_reference(
    data: st.DataObject, algo: str, block_size: int, lookahead: int
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 200_000), max_size=90))
    lora = data.draw(st.one_of(st.none(), st.tuples(st.text(max_size=5), st.text(max_size=8))))
    salt = data.draw(st.one_of(st.none(), st.text(max_size=6)))
    mm = data.draw(mm_items(len(tokens)))
    num_blocks = max(0, (len(tokens) - lookahead) // block_size)
    digests = data.draw(
        st.one_of(
            st.none(), st.lists(st.binary(min_size=32, max_size=32), min_size=num_blocks, max_size=num_blocks)
        )
    )
    expected = reference_chain(algo, "7", block_size, tokens, lora, mm, salt, digests, lookahead)
    keywords: dict[str, Any] = {
        "cache_salt": salt,
        "mm": [MMItem(i, o, n) for i, o, n in mm],
        "prompt_embeds_digests": digests,
        "lookahead": lookahead,
    }
    if lora is not None:
        keywords.update(lora_name=lora[0], lora_path=lora[1])
    hasher = BlockHasher(algo=algo, block_size=block_size, seed="7")
    assert hasher.block_hashes(tokens, **keywords) == expected
    assert hasher.block_hashes(tokens, **keywords) == expected
    published = hasher.event_extra_keys(tokens, **keywords)
    assert len(published) == len(expected)
    for index, keys in enumerate(published):
        start, end = index * block_size, (index + 1) * block_size + lookahead
        tagged = reference_extra_keys(start, end, lora, mm, salt, None if digests is None else digests[index])
        assert keys == (None if tagged is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in tagged))


@fast
@given(tokens=st.lists(st.integers(0, 150_000), min_size=1, max_size=100), algo=algos, data=st.data())
def test_one_changed_token_changes_its_block_and_every_later_one_only(
    tokens: list[int], algo: str, data: st.DataObject
) -> None:
    block_size = data.draw(st.sampled_from([1, 3, 16]))
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 150_000).filter(lambda t: t != tokens[position]))
    hasher = BlockHasher(algo=algo, block_size=block_size, seed="1")
    before, after = hasher.block_hashes(tokens), hasher.block_hashes(changed)
    block = position // block_size
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:], strict=True))


@fast
@given(
    turns=st.lists(st.lists(st.integers(0, 150_000), max_size=70), min_size=1, max_size=8),
    algo=algos,
    memo_size=st.sampled_from([1, 17, 40, 4096]),
    defer_records=st.booleans(),
    flushes=st.lists(st.booleans(), min_size=24, max_size=24),
)
def test_memo_on_and_off_agree_on_growing_conversations(
    turns: list[list[int]], algo: str, memo_size: int, defer_records: bool, flushes: list[bool]
) -> None:
    """Shared prefixes, growing prompts, forks and tiny memos that evict constantly never change a hash;
    nor do deferred records, flushed at any point or left for the next prompt to flush."""
    with_memo = BlockHasher(
        algo=algo, block_size=2, seed="0", memo_size=memo_size, defer_records=defer_records
    )
    without = BlockHasher(algo=algo, block_size=2, seed="0", memo_size=0)
    prompt: list[int] = list(range(300))  # a shared system prompt spanning several memo segments
    flush_at = iter(flushes * 2)
    for turn in turns:
        prompt = prompt + turn
        fork = prompt[:-1] + [150_001]
        for tokens in (prompt, fork, prompt):
            assert with_memo.block_hashes(tokens) == without.block_hashes(tokens)
            if next(flush_at):
                with_memo.flush_memo()
            assert with_memo.event_hashes(tokens) == without.event_hashes(tokens)


@pytest.mark.parametrize("packed", [False, True])
def test_deferred_records_wait_for_a_flush_or_the_next_prompt(packed: bool) -> None:
    """With defer_records a prompt's digests reach the memo only at flush_memo, or when the next prompt
    reads the memo; the results never differ from an eager hasher's."""
    expected_digests = BlockHasher(algo="sha256", block_size=16, seed="0", memo_size=0)
    prompt = list(range(1000, 1000 + 16 * 40))
    tokens: Any = array("I", prompt) if packed else prompt
    deferred = BlockHasher(algo="sha256", block_size=16, seed="0", defer_records=True)
    eager = BlockHasher(algo="sha256", block_size=16, seed="0")
    memo, eager_memo = deferred._memo, eager._memo
    assert memo is not None and eager_memo is not None
    assert deferred.event_key_array(tokens) == eager.event_key_array(tokens)
    assert len(eager_memo) == 40 and len(memo) == 0  # queued, not yet held
    deferred.flush_memo()
    assert len(memo) == 40
    deferred.flush_memo()  # nothing left: a no-op
    assert len(memo) == 40
    longer = prompt + list(range(16 * 8))
    assert (
        deferred.block_hashes(longer) == eager.block_hashes(longer) == expected_digests.block_hashes(longer)
    )
    assert len(memo) == 40 < len(eager_memo)  # the new blocks wait in the queue
    known = prompt[: 16 * 32]  # two memoised segments: nothing new to record
    assert deferred.block_hashes(known) == eager.block_hashes(known)
    assert len(memo) == len(eager_memo)  # that prompt's lookup flushed them first


def test_memo_is_safe_across_threads() -> None:
    shared = BlockHasher(algo="sha256_cbor", block_size=4, seed="0", memo_size=64)
    prompts = [list(range(k, k + 600)) for k in range(0, 40, 4)] + [
        list(range(600 + k)) for k in range(0, 400, 37)
    ]
    expected = [
        BlockHasher(algo="sha256_cbor", block_size=4, seed="0", memo_size=0).block_hashes(p) for p in prompts
    ]
    failures: list[str] = []

    def worker(offset: int) -> None:
        for round_ in range(4):
            for index in range(len(prompts)):
                pick = (index + offset + round_) % len(prompts)
                if shared.block_hashes(prompts[pick]) != expected[pick]:
                    failures.append(f"prompt {pick}")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([1, True, 3], "bool"),
        ([1, 2.0], "float"),
        (["1"], "str"),
        ([None], "null"),
        ([-1], "non-negative"),
        ([2**64, -5], "non-negative"),
        ("123", "list of integers"),
        (5, "list"),
    ],
)
def test_bad_tokens_raise_hashing_error(tokens: Any, needle: str) -> None:
    hasher = BlockHasher(algo="sha256", block_size=2, seed="0")
    hasher.block_hashes([1, 2, 3, 4])  # a warm memo must not let bad input through either
    with pytest.raises(HashingError, match=needle):
        hasher.block_hashes(tokens)
    with pytest.raises(HashingError):
        hasher.event_hashes(tokens)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"algo": "sha1"}, "unknown hash algorithm"),
        ({"algo": "sha256", "block_size": 0}, "block_size"),
        ({"algo": "sha256", "block_size": -16}, "block_size"),
        ({"algo": "sha256", "block_size": True}, "block_size"),
        ({"algo": "sha256", "block_size": 16.0}, "block_size"),
        ({"algo": "xxhash", "seed": None}, "PYTHONHASHSEED"),
        ({"algo": "xxhash_cbor", "seed": None}, "PYTHONHASHSEED"),
        ({"algo": "sha256", "seed": 0}, "string"),
        ({"algo": "sha256", "memo_size": -1}, "memo_size"),
    ],
)
def test_bad_construction_raises_hashing_error(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(HashingError, match=needle):
        BlockHasher(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mm": [MMItem("a", -1, 3)]}, "offset"),
        ({"mm": [MMItem("a", 0, 0)]}, "length"),
        ({"mm": [MMItem("", 0, 2)]}, "identifier"),
        ({"mm": [MMItem("a", 4, 2), MMItem("b", 1, 2)]}, "sorted"),
        ({"mm": [("a", 1, 2)]}, "MMItem"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_path": "/p"}, "lora_name"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"prompt_embeds_digests": [b"x"]}, "digests"),
        ({"prompt_embeds_digests": ["ab", "cd"]}, "bytes"),
        ({"lookahead": -1}, "lookahead"),
    ],
)
def test_bad_extra_inputs_raise_hashing_error(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(HashingError, match=needle):
        BlockHasher(algo="sha256", block_size=2, seed="0").block_hashes([1, 2, 3, 4], **kwargs)


def test_hashing_error_is_a_value_error() -> None:
    assert issubclass(HashingError, ValueError)


def test_event_hash_is_the_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")


@pytest.mark.parametrize("bad", [True, False, 3.0, "7", None, -1])
@pytest.mark.parametrize("position", [0, 17, 260, 300, 301])
def test_bad_token_inside_a_memoised_prefix_is_still_refused(bad: Any, position: int) -> None:
    """The memo must never vouch for a bad id just because the ints around it are known."""
    tokens = list(range(1, 303))
    hasher = BlockHasher(algo="sha256_cbor", block_size=16, seed="0")
    expected = hasher.block_hashes(tokens)
    assert hasher.block_hashes(list(tokens)) == expected  # warm: every block is a memo hit now
    poisoned = list(tokens)
    poisoned[position] = bad
    with pytest.raises(HashingError, match="non-negative integers"):
        hasher.block_hashes(poisoned)
    assert hasher.block_hashes(tokens) == expected


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
@pytest.mark.parametrize("position", [0, 5, 255, 256, 300, 319])
@pytest.mark.parametrize("container", [list, tuple])
def test_a_bool_standing_exactly_for_a_memoised_0_or_1_is_refused(
    algo: str, position: int, container: Any
) -> None:
    """True/False pack exactly like 1/0, so a memo hit alone would vouch for them; it must not."""
    tokens = [(7 * index) % 3 for index in range(322)]  # 0, 1 and 2 everywhere: segments and tail blocks
    hasher = BlockHasher(algo=algo, block_size=16, seed="0")
    expected = reference_chain(algo, "0", 16, tokens)
    assert hasher.block_hashes(container(tokens)) == expected
    assert hasher.block_hashes(container(tokens)) == expected  # fully memoised now
    poisoned = list(tokens)
    if poisoned[position] == 2:
        position += 1
    poisoned[position] = bool(poisoned[position])
    with pytest.raises(HashingError, match="bool"):
        hasher.block_hashes(container(poisoned))
    assert hasher.block_hashes(container(tokens)) == expected


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_memo_segment_tags_that_collide_never_change_a_hash(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments are looked up by a 128-bit tag of their tokens; with every tag equal (a forced collision)
    the stored tokens must still decide, so results stay those of the reference."""
    import xxhash as xxhash_module

    monkeypatch.setattr(xxhash_module, "xxh3_128_intdigest", lambda data: 7)
    hasher = BlockHasher(algo=algo, block_size=4, seed="0")
    system = list(range(2, 130))
    prompts = [system + [1000 + turn] * 70 for turn in range(4)] + [list(range(500, 700)), system]
    for prompt in prompts + prompts:
        assert hasher.block_hashes(prompt) == reference_chain(algo, "0", 4, prompt)
