"""score_prefix against a brute-force scorer written from the definition (per pod, block by block)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.indexer.events import TIER_CPU, TIER_GPU, BlocksStored, PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.scorer import PodScore, score_prefix

# Every KVIndex here is built once on each shard core (tests/indexer/conftest.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("index_core")]

TIERS = (TIER_GPU, TIER_CPU, "STORAGE")
# Powers of two: sums are exact, so scores compare with == and ties are real ties.
EXACT_WEIGHTS = {TIER_GPU: 1.0, TIER_CPU: 0.5}
EXACT_UNKNOWN = 0.125


def brute_force(
    holdings: Mapping[PodRef, Mapping[str, set[int]]],
    prompt: Sequence[int],
    block_size: int,
    weights: Mapping[str, float],
    unknown: float,
    pods: Collection[str] | None,
) -> list[tuple[str, int, int, int, float, dict[str, int]]]:
    rows = []
    for pod, tiers in holdings.items():
        if pods is not None and pod.pod_id not in pods:
            continue
        matched = 0
        score = 0.0
        while matched < len(prompt) and any(prompt[matched] in keys for keys in tiers.values()):
            score += max(weights.get(t, unknown) for t, keys in tiers.items() if prompt[matched] in keys)
            matched += 1
        by_tier = {}
        for tier, keys in tiers.items():
            run = 0
            while run < len(prompt) and prompt[run] in keys:
                run += 1
            if run:
                by_tier[tier] = run
        if matched:
            rows.append((pod.pod_id, pod.dp_rank, matched, matched * block_size, score, by_tier))
    rows.sort(key=lambda r: (-r[4], -r[2], r[0], r[1]))
    return rows


def as_rows(scores: list[PodScore]) -> list[tuple[str, int, int, int, float, dict[str, int]]]:
    return [(s.pod_id, s.dp_rank, s.matched_blocks, s.matched_tokens, s.score, s.by_tier) for s in scores]


def build(holdings: Mapping[PodRef, Mapping[str, set[int]]]) -> KVIndex:
    index = KVIndex(num_shards=4)
    for pod, tiers in holdings.items():
        for tier, keys in tiers.items():
            event = BlocksStored(
                block_keys=tuple(sorted(keys)), parent_key=None, token_ids=(), block_size=4, tier=tier
            )
            index.apply(pod, [event])
    return index


holdings_strategy = st.dictionaries(
    st.builds(PodRef, st.sampled_from("abcd"), st.integers(0, 1)),
    st.dictionaries(st.sampled_from(TIERS), st.sets(st.integers(0, 11), max_size=12), max_size=3),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(
    holdings=holdings_strategy,
    prompt=st.lists(st.integers(0, 11), max_size=12, unique=True),
    pods=st.none() | st.sets(st.sampled_from("abcz")),
)
def test_matches_brute_force(
    holdings: dict[PodRef, dict[str, set[int]]], prompt: list[int], pods: set[str] | None
) -> None:
    index = build(holdings)
    got = score_prefix(
        index, prompt, block_size=4, tier_weights=EXACT_WEIGHTS, unknown_tier_weight=EXACT_UNKNOWN, pods=pods
    )
    assert as_rows(got) == brute_force(holdings, prompt, 4, EXACT_WEIGHTS, EXACT_UNKNOWN, pods)


def test_default_weights_prefer_gpu_then_cpu_then_unknown_tiers() -> None:
    prompt = [1, 2, 3]
    holdings = {
        PodRef("gpu"): {TIER_GPU: {1, 2, 3}},
        PodRef("cpu"): {TIER_CPU: {1, 2, 3}},
        PodRef("storage"): {"STORAGE": {1, 2, 3}},
        PodRef("mixed"): {TIER_GPU: {1}, TIER_CPU: {1, 2, 3}},
    }
    got = score_prefix(build(holdings), prompt, block_size=16)
    assert [s.pod_id for s in got] == ["gpu", "mixed", "cpu", "storage"]
    assert got[1].score == pytest.approx(1.0 + 0.8 + 0.8)
    assert got[1].by_tier == {TIER_GPU: 1, TIER_CPU: 3}
    assert got[3].score == pytest.approx(0.3)
    assert all(s.matched_blocks == 3 and s.matched_tokens == 48 for s in got)


def test_ties_break_on_matched_blocks_then_pod_then_rank() -> None:
    holdings = {
        PodRef("b", 1): {TIER_GPU: {1, 2}},
        PodRef("b", 0): {TIER_GPU: {1, 2}},
        PodRef("a"): {TIER_GPU: {1, 2}},
        # The same score (4 x 0.5) over more blocks ranks first.
        PodRef("z"): {TIER_CPU: {1, 2, 3, 4}},
    }
    got = score_prefix(build(holdings), [1, 2, 3, 4], block_size=1, tier_weights=EXACT_WEIGHTS)
    assert [(s.pod_id, s.dp_rank) for s in got] == [("z", 0), ("a", 0), ("b", 0), ("b", 1)]


def test_nothing_matched_is_an_empty_list() -> None:
    index = build({PodRef("a"): {TIER_GPU: {5}}})
    assert score_prefix(index, [1, 5], block_size=16) == []
    assert score_prefix(index, [], block_size=16) == []
