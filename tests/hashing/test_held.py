"""BlockHasher.event_hashes(held=...): hashing stops after a block no pod holds, and what it returns is
always a prefix of the whole prompt's keys at which a longest-prefix lookup stops where it would over the
whole prompt. Expected keys come from the reference formula (test_properties.reference_chain)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvindex.hashing import HASH_ALGOS, BlockHasher, MMItem, event_hash
from kvindex.hashing.hasher import MIN_HELD_STRETCH_BLOCKS
from reference import mm_items, reference_chain

# Both hash cores (tests/hashing/conftest.py).
pytestmark = pytest.mark.usefixtures("hash_core")
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_keys(algo: str, block_size: int, tokens: list[int], **extras: Any) -> list[int]:
    return [event_hash(d) for d in reference_chain(algo, "3", block_size, tokens, **extras)]


def leading(keys: list[int], held: set[int]) -> int:
    """How many leading keys are held: where a longest-prefix lookup stops."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count


def counting(held: set[int]) -> tuple[Callable[[int], bool], list[int]]:
    asked: list[int] = []

    def check(key: int) -> bool:
        asked.append(key)
        return key in held

    return check, asked


@st.composite
def held_sets(draw: st.DrawFn, keys: list[int]) -> set[int]:
    """A held run from block 0 (of any length), plus scattered held blocks after it."""
    run = draw(st.integers(0, len(keys)))
    scattered = draw(st.sets(st.sampled_from(keys), max_size=len(keys))) if keys else set()
    return set(keys[:run]) | scattered


def assert_stops_where_the_whole_prompt_does(got: list[int], whole: list[int], held: set[int]) -> None:
    assert got == whole[: len(got)]
    assert leading(got, held) == leading(whole, held)
    if len(got) < len(whole):
        assert got[-1] not in held  # it only stops after a block no pod holds


@fast
@given(
    data=st.data(),
    algo=st.sampled_from(HASH_ALGOS),
    block_size=st.sampled_from([1, 2, 16]),
    memo_size=st.sampled_from([0, 40, 4096]),
    form=st.sampled_from(["list", "tuple", "array"]),
)
def test_a_plain_prompt_stops_where_the_whole_prompt_would(
    data: st.DataObject, algo: str, block_size: int, memo_size: int, form: str
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 200_000), max_size=700))
    whole = reference_keys(algo, block_size, tokens)
    held = data.draw(held_sets(whole))
    hasher = BlockHasher(algo=algo, block_size=block_size, seed="3", memo_size=memo_size)
    prompt: Any = {"list": list, "tuple": tuple, "array": lambda t: array("I", t)}[form](tokens)
    check, asked = counting(held)
    got = hasher.event_hashes(prompt, held=check)
    assert_stops_where_the_whole_prompt_does(got, whole, held)
    assert all(key in got for key in asked)  # only blocks it hashed are asked about
    # What the memo recorded of the part hashed must serve the whole prompt and a second stop alike.
    assert hasher.event_hashes(prompt) == whole
    assert_stops_where_the_whole_prompt_does(hasher.event_hashes(prompt, held=held.__contains__), whole, held)


@fast
@given(data=st.data(), algo=st.sampled_from(HASH_ALGOS), block_size=st.sampled_from([1, 4]))
def test_a_prompt_with_extra_keys_stops_where_the_whole_prompt_would(
    data: st.DataObject, algo: str, block_size: int
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 200_000), max_size=300))
    lora = data.draw(st.one_of(st.none(), st.tuples(st.text(max_size=5), st.text(max_size=8))))
    salt = data.draw(st.one_of(st.none(), st.text(min_size=1, max_size=6)))
    mm = data.draw(mm_items(len(tokens)))
    whole = reference_keys(algo, block_size, tokens, lora=lora, mm=mm, salt=salt)
    held = data.draw(held_sets(whole))
    keywords: dict[str, Any] = {"cache_salt": salt, "mm": [MMItem(i, o, n) for i, o, n in mm]}
    if lora is not None:
        keywords.update(lora_name=lora[0], lora_path=lora[1])
    hasher = BlockHasher(algo=algo, block_size=block_size, seed="3")
    assert_stops_where_the_whole_prompt_does(
        hasher.event_hashes(tokens, held=held.__contains__, **keywords), whole, held
    )
    assert hasher.event_hashes(tokens, **keywords) == whole


def test_a_prompt_nobody_holds_hashes_one_stretch_and_asks_once() -> None:
    tokens = list(range(100_000, 100_000 + 512 * 16))
    check, asked = counting(set())
    got = BlockHasher(algo="sha256", block_size=16, seed="3").event_hashes(tokens, held=check)
    assert got == reference_keys("sha256", 16, tokens[: MIN_HELD_STRETCH_BLOCKS * 16])
    assert asked == [got[-1]]


def test_a_prompt_held_to_its_end_is_hashed_whole_with_few_questions() -> None:
    tokens = [(7919 * i) % 150_000 for i in range(6_400)]  # 6,400 blocks of one token
    whole = reference_keys("sha256", 1, tokens)
    check, asked = counting(set(whole))
    assert BlockHasher(algo="sha256", block_size=1, seed="3").event_hashes(tokens, held=check) == whole
    # Stretches of 32 blocks up to 256, then an eighth of the chain each: ~8 + log(25) / log(9/8) asks.
    assert 20 <= len(asked) <= 40, len(asked)


def test_blocks_the_memo_knows_are_asked_about_before_any_hashing() -> None:
    tokens = list(range(20_000, 20_000 + 300 * 16))
    hasher = BlockHasher(algo="sha256", block_size=16, seed="3")
    known = hasher.event_hashes(tokens[: 100 * 16])  # the memo now holds the first 100 blocks
    check, asked = counting(set())
    assert hasher.event_hashes(tokens, held=check) == known
    assert asked == [known[-1]]
