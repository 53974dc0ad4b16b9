"""Stage 5 of the read path: a score answer's entries, with each pod's state, as JSON.

Two ways to the same bytes. The definition: `score_holders` builds one PodScore per pod, `with_health`
adds each pod's state and event age (leaving out pods outside the asked states) and msgspec encodes the
list. The compiled writer (api/_answer.c, built by `pip install` when a C compiler is present) ranks and
writes the common shape -- one tier per pod among the first block's holders -- without a Python object
per entry, and declines everything else to the definition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
from kvindex.api.schemas import JSON_ENCODER
from kvindex.hashing.compiled import describe_choice, pure_python_forced
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import HolderIds
from kvindex.indexer.scorer import PodScore, score_holders
from kvindex.indexer.status import VOUCHED_STATES, HealthReader, PodHealth
from kvindex.indexer.store import Store


class EncodeScores(Protocol):
    def __call__(
        self,
        holder_ids: list[HolderIds],
        first_entries: list[tuple[PodRef, str]] | None,
        entry_of: Callable[[int], tuple[PodRef, str]],
        healths: list[PodHealth | None] | HealthReader,
        tier_weights: dict[str, float],
        unknown_tier_weight: float,
        block_size: int,
        report_tiers: tuple[str, ...],
        states: frozenset[str] | None,
        vouched_states: frozenset[str],
        grace_s: float,
        by_score: bool,
        compact: bool,
        /,
    ) -> tuple[bytes, int] | None: ...


# refs -> each one's health, None where no stream feeds it (IngestService.pod_healths).
HealthsOf = Callable[[Sequence[PodRef]], list[PodHealth | None]]


def load_extension() -> EncodeScores | None:
    """kvindex.api._answer's encode_scores if it was built, whatever KVINDEX_PURE_PYTHON says."""
    try:
        from kvindex.api import _answer
    except ImportError:  # not built: no compiler at install time
        return None
    return _answer.encode_scores


# NOTE: read per request, so a test can run both paths in one process by setting this.
encode_scores: EncodeScores | None = None if pure_python_forced() else load_extension()


def describe() -> str:
    """One line for the logs: which writer runs."""
    compiled = "compiled writer" if encode_scores is not None else None
    return describe_choice("score answers", compiled, "Python", "the compiled writer")


class AnswerPolicy(msgspec.Struct, frozen=True):
    """How entries are weighed, filtered and ordered: the server's settings and the request's asks."""

    block_size: int
    tier_weights: Mapping[str, float]
    unknown_tier_weight: float
    report_tiers: tuple[str, ...]
    grace_s: float  # a disconnected pod is left out after this long, unless `states` asks for it
    states: frozenset[str] | None = None  # only pods in these states (None: the default filter)
    by_score: bool = True  # False: rank "trust", vouched pods first
    compact: bool = False  # each entry as CompactPodScore (the request's "answer": "compact")


def with_health(
    pod_scores: Sequence[PodScore], healths: Sequence[PodHealth | None], policy: AnswerPolicy
) -> list[PodScore]:
    """Each entry with its pod's state and event age; pods outside the asked states (by default:
    disconnected past the grace) left out; with rank "trust", vouched pods first (each group keeps the
    scorer's best-first order)."""
    vouched: list[PodScore] = []
    others: list[PodScore] = []
    states = policy.states
    replace = msgspec.structs.replace
    for entry, health in zip(pod_scores, healths, strict=True):
        if health is None:  # entries no stream feeds (an index filled directly): as they are
            vouched.append(entry)
            continue
        if states is not None:
            if health.state not in states:
                continue
        elif health.disconnected_for_s is not None and health.disconnected_for_s > policy.grace_s:
            continue
        entry = replace(entry, state=health.state, last_event_age_s=health.last_event_age_s)
        (vouched if policy.by_score or health.state in VOUCHED_STATES else others).append(entry)
    return vouched + others if others else vouched


def answer_scores(
    index: Store, holder_ids: list[HolderIds], healths_of: HealthsOf, policy: AnswerPolicy
) -> list[PodScore]:
    """The answer's entries as PodScores (the definition of what `scores_json` writes)."""
    pod_scores = score_holders(
        index,
        holder_ids,
        block_size=policy.block_size,
        tier_weights=policy.tier_weights,
        unknown_tier_weight=policy.unknown_tier_weight,
        report_tiers=policy.report_tiers,
    )
    healths = healths_of([PodRef(entry.pod_id, entry.dp_rank) for entry in pod_scores])
    return with_health(pod_scores, healths, policy)


def scores_json(
    index: Store,
    holder_ids: list[HolderIds],
    healths_of: HealthsOf,
    policy: AnswerPolicy,
    reader: HealthReader | None = None,
) -> tuple[bytes, int]:
    """The JSON of the answer's `scores` list and the best entry's matched_blocks (0 if none).

    `reader`: the streams' health for the compiled writer to read itself (the same as `healths_of`
    would say at `reader.now`); without it the writer is given `healths_of`'s answers."""
    encode = encode_scores
    if encode is not None and holder_ids:
        first_entries: list[tuple[PodRef, str]] | None = None  # the writer reads them itself
        healths: list[PodHealth | None] | HealthReader
        if reader is not None:
            healths = reader
        else:
            first_entries = list(map(index.entry, holder_ids[0]))
            healths = healths_of([ref for ref, _ in first_entries])
        written = encode(*encode_arguments(index, holder_ids, first_entries, healths, policy))
        if written is not None:
            return written
    entries = answer_scores(index, holder_ids, healths_of, policy)
    return encode_entries(entries, compact=policy.compact), entries[0].matched_blocks if entries else 0


def encode_entries(entries: Sequence[PodScore], *, compact: bool) -> bytes:
    """The `scores` JSON of these entries: full objects, or CompactPodScore arrays."""
    if compact:
        return JSON_ENCODER.encode(
            [(entry.pod_id, entry.dp_rank, entry.matched_blocks, entry.score) for entry in entries]
        )
    return JSON_ENCODER.encode(entries)


def encode_arguments(
    index: Store,
    holder_ids: list[HolderIds],
    first_entries: list[tuple[PodRef, str]] | None,
    healths: list[PodHealth | None] | HealthReader,
    policy: AnswerPolicy,
) -> tuple[Any, ...]:
    """encode_scores' arguments, in its order, for this answer and policy (`first_entries` None: the
    writer reads the first block's entries by `index.entry`)."""
    return (
        holder_ids,
        first_entries,
        index.entry,
        healths,
        _as_dict(policy.tier_weights),
        policy.unknown_tier_weight,
        policy.block_size,
        policy.report_tiers,
        policy.states,
        VOUCHED_STATES,
        policy.grace_s,
        policy.by_score,
        policy.compact,
    )


def _as_dict(weights: Mapping[str, float]) -> dict[str, float]:
    return weights if type(weights) is dict else dict(weights)
