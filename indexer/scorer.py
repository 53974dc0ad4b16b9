"""Stage 4 of the read path: turn an index lookup into per-pod longest-prefix scores.

Pure policy over the index's mechanism: one `lookup_ids` call, then arithmetic over the runs of identical
holder sets (a shared prefix is usually held by the same pods block after block, so the cost is per run
of the prompt, not per block).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from itertools import groupby
from types import MappingProxyType

import msgspec
from kvindex.indexer.events import TIER_CPU, TIER_GPU, PodRef
from kvindex.indexer.index import Entry, HolderIds
from kvindex.indexer.store import Store

# A block on GPU is reusable at once; CPU needs a copy back first. Tiers not named here (STORAGE, custom
# connector tiers) get `unknown_tier_weight`: explicitly low, still better than recomputing.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({TIER_GPU: 1.0, TIER_CPU: 0.8})
DEFAULT_UNKNOWN_TIER_WEIGHT = 0.1
NO_WEIGHT = float("-inf")


class PodScore(msgspec.Struct, frozen=True):
    """How much of a prompt's prefix one pod (dp rank) holds.

    Encodes (msgspec) as one entry of the score API's `scores` list, so the HTTP layer sends these
    as they are: the pod id goes out under the key "pod".
    """

    pod_id: str = msgspec.field(name="pod")
    dp_rank: int
    matched_blocks: int  # longest run of leading blocks held on any tier
    matched_tokens: int  # matched_blocks * block_size
    score: float  # sum over that run of each block's best tier weight
    # Per tier, the longest leading run held on that tier alone: the report tiers (see score_prefix),
    # then the other tiers with a non-zero run, by name.
    by_tier: dict[str, int]
    # The pod's ingest state and seconds since its last event, filled in by the read path (the scorer
    # knows only the index).
    state: str = "live"
    last_event_age_s: float | None = None


def score_prefix(
    index: Store,
    block_keys: Sequence[int],
    *,
    block_size: int,
    tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    unknown_tier_weight: float = DEFAULT_UNKNOWN_TIER_WEIGHT,
    pods: Collection[str] | None = None,
    report_tiers: Sequence[str] = (),
) -> list[PodScore]:
    """Score every pod (restricted to `pods` ids if given) on the leading blocks of `block_keys`.

    Best first: score desc, then matched_blocks desc, then pod id and dp rank ascending. Pods matching
    no leading block are omitted. Every tier in `report_tiers` is in each `by_tier`, first and in that
    order, with 0 when the pod's run there is empty (what a router indexing blindly needs).
    """
    return score_holders(
        index,
        index.lookup_ids(block_keys, pods),
        block_size=block_size,
        tier_weights=tier_weights,
        unknown_tier_weight=unknown_tier_weight,
        report_tiers=report_tiers,
    )


def score_holders(
    index: Store,
    holder_ids: Sequence[HolderIds],
    *,
    block_size: int,
    tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    unknown_tier_weight: float = DEFAULT_UNKNOWN_TIER_WEIGHT,
    report_tiers: Sequence[str] = (),
) -> list[PodScore]:
    """score_prefix from an answer of `index.lookup_ids` (the read path looks up once, whichever scorer
    then runs)."""
    if not holder_ids:
        return []
    # Collapse the answer into runs of one holder set (a shared prefix is held by the same pods block
    # after block, as one interned tuple), so the work below is per run, not per block. groupby compares
    # with an identity shortcut, so the scan over the prompt stays in C.
    runs: list[tuple[HolderIds, int]] = [
        (holders, len(list(group))) for holders, group in groupby(holder_ids)
    ]
    entries = {entry_id: index.entry(entry_id) for entry_id in set().union(*[holders for holders, _ in runs])}
    if len({pod for pod, _ in entries.values()}) == len(entries):
        return _score_single_entry_pods(
            runs, entries, block_size, tier_weights, unknown_tier_weight, report_tiers
        )

    # Pods are numbered per call, so the loops below hash small ints, not PodRef structs.
    pods_seen: list[PodRef] = []
    pod_numbers: dict[PodRef, int] = {}
    entry_pod: dict[int, int] = {}
    entry_tier: dict[int, str] = {}
    entry_weight: dict[int, float] = {}
    for entry_id, (pod, tier) in entries.items():
        pod_no = pod_numbers.get(pod)
        if pod_no is None:
            pod_no = pod_numbers[pod] = len(pods_seen)
            pods_seen.append(pod)
        entry_pod[entry_id] = pod_no
        entry_tier[entry_id] = tier
        entry_weight[entry_id] = tier_weights.get(tier, unknown_tier_weight)

    # Only holders of block 0 can match anything; they drop out at their first missing block.
    first = holder_ids[0]
    live_entries = set(first)
    live_pods = {entry_pod[entry_id] for entry_id in first}
    entry_run: dict[int, int] = {}
    pod_matched: dict[int, int] = {}
    pod_score: dict[int, float] = dict.fromkeys(live_pods, 0.0)

    position = 0
    for holders, run_length in runs:
        if not live_pods:
            break
        if position:
            gone = live_entries.difference(holders)
            for entry_id in gone:
                entry_run[entry_id] = position
            live_entries -= gone
        best_weight: dict[int, float] = {}
        for entry_id in holders:
            pod_no = entry_pod[entry_id]
            if pod_no in live_pods:
                weight = entry_weight[entry_id]
                if weight > best_weight.get(pod_no, NO_WEIGHT):
                    best_weight[pod_no] = weight
        if len(best_weight) < len(live_pods):
            for pod_no in live_pods.difference(best_weight):
                pod_matched[pod_no] = position
            live_pods.intersection_update(best_weight)
        for pod_no, weight in best_weight.items():
            pod_score[pod_no] += weight * run_length
        position += run_length
    for entry_id in live_entries:
        entry_run[entry_id] = position
    for pod_no in live_pods:
        pod_matched[pod_no] = position

    pod_runs: dict[int, dict[str, int]] = {pod_no: {} for pod_no in pod_matched}
    for entry_id, run in entry_run.items():
        if run:
            pod_runs[entry_pod[entry_id]][entry_tier[entry_id]] = run
    pod_by_tier = {pod_no: _by_tier(runs_by_tier, report_tiers) for pod_no, runs_by_tier in pod_runs.items()}
    ranked = sorted(
        (-pod_score[pod_no], -matched, pods_seen[pod_no].pod_id, pods_seen[pod_no].dp_rank, pod_no)
        for pod_no, matched in pod_matched.items()
        if matched
    )
    return [
        PodScore(
            pod_id=pod_id,
            dp_rank=dp_rank,
            matched_blocks=-neg_matched,
            matched_tokens=-neg_matched * block_size,
            score=-neg_score,
            by_tier=pod_by_tier[pod_no],
        )
        for neg_score, neg_matched, pod_id, dp_rank, pod_no in ranked
    ]


def _score_single_entry_pods(
    runs: list[tuple[HolderIds, int]],
    entries: Mapping[int, Entry],
    block_size: int,
    tier_weights: Mapping[str, float],
    unknown_tier_weight: float,
    report_tiers: Sequence[str],
) -> list[PodScore]:
    """The common shape, without per-pod bookkeeping: every entry in the answer is a different pod.

    Then a pod's run is its one entry's run, its score weight x run and its by_tier that one tier.
    """
    entry_run: dict[int, int] = {}
    live = set(runs[0][0])
    position = 0
    for holders, run_length in runs:
        if position:
            gone = live.difference(holders)
            for entry_id in gone:
                entry_run[entry_id] = position
            live -= gone
            if not live:
                break
        position += run_length
    for entry_id in live:
        entry_run[entry_id] = position
    # Most holders share a run (the whole shared prefix) and a tier, so rank per (run, tier) group and sort only within a group, by pod (PodRef orders by pod id, then dp rank).
    groups: dict[tuple[int, str], list[PodRef]] = {}
    for entry_id, run in entry_run.items():
        pod, tier = entries[entry_id]
        group = groups.get((run, tier))
        if group is None:
            groups[(run, tier)] = [pod]
        else:
            group.append(pod)
    ranked = sorted(
        (-tier_weights.get(tier, unknown_tier_weight) * run, -run, tier, pods)
        for (run, tier), pods in groups.items()
    )
    zeros = dict.fromkeys(report_tiers, 0)
    scores: list[PodScore] = []
    for (neg_score, neg_run), tied in groupby(ranked, key=_rank):
        run, score, matched_tokens = -neg_run, -neg_score, -neg_run * block_size
        tied_groups = list(tied)
        if len(tied_groups) == 1:
            _, _, tier, pods = tied_groups[0]
            pods.sort()
            by_tier = zeros | {tier: run}
            scores.extend(
                [
                    PodScore(pod.pod_id, pod.dp_rank, run, matched_tokens, score, by_tier.copy())
                    for pod in pods
                ]
            )
        else:  # tiers of equal weight tie: one pod order across them
            members = sorted((pod, tier) for _, _, tier, pods in tied_groups for pod in pods)
            scores.extend(
                [
                    PodScore(pod.pod_id, pod.dp_rank, run, matched_tokens, score, zeros | {tier: run})
                    for pod, tier in members
                ]
            )
    return scores


def _rank(group: tuple[float, int, str, list[PodRef]]) -> tuple[float, int]:
    return group[0], group[1]


def _by_tier(runs: Mapping[str, int], report_tiers: Sequence[str]) -> dict[str, int]:
    """The report tiers in order (0 when absent), then the other tiers with a non-zero run, by name."""
    by_tier = {tier: runs.get(tier, 0) for tier in report_tiers}
    for tier in sorted(runs):
        if tier not in by_tier and runs[tier] > 0:
            by_tier[tier] = runs[tier]
    return by_tier
