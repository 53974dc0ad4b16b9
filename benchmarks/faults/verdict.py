"""Fault harness, the verdict: kvindex's view of one (pod, dp rank) against the engine's own cache.

The rule being proven: once every engine has been quiet for `quiet_probe_after_s` plus one probe
round, kvindex's index equals each engine's cache exactly for every pod whose lost history is still in
its ring; for any other pod it claims no block the engine does not hold, and says so in `/v1/pods`
(state `resyncing` or `partial_view: true`). Pure: values in, verdicts out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

PodOutcome = Literal["exact", "flagged", "unseen", "flagged_needlessly", "divergent"]
# Worst first is last: a schedule's outcome is its worst pod's (or "error" if the run itself failed).
OUTCOME_ORDER: tuple[str, ...] = ("exact", "flagged", "unseen", "flagged_needlessly", "divergent", "error")
FLAGGED_STATES = frozenset({"resyncing"})


class PodVerdict(msgspec.Struct, frozen=True):
    engine: str  # the schedule's name for it, e.g. "p1.0"
    outcome: PodOutcome
    held: int  # blocks the engine holds
    claimed: int  # blocks kvindex says it holds
    extra: int  # claimed but not held: never allowed
    missing: int  # held but not claimed: allowed only while flagged, and only if the ring lost history
    state: str | None  # None: kvindex does not list the pod at all
    partial_view: bool
    history: int  # batches since the engine's cache was last empty (start or AllBlocksCleared)
    ring: int  # the engine's buffer_steps

    def describe(self) -> str:
        listed = "not listed in /v1/pods" if self.state is None else f"state {self.state}"
        if self.partial_view:
            listed += ", partial_view"
        ring = "its ring holds them all" if self.history <= self.ring else "more than its ring holds"
        return (
            f"{self.engine}: {self.outcome} — engine holds {self.held}, kvindex claims {self.claimed} "
            f"({self.extra} not held, {self.missing} missing); {listed}; {self.history} batches since "
            f"its cache was last empty, ring {self.ring} ({ring})"
        )


def judge(
    engine: str,
    held: frozenset[int],
    claims: frozenset[int],
    *,
    state: str | None,
    partial_view: bool,
    history: int,
    ring: int,
    unseeable: bool = False,
) -> PodVerdict:
    """exact: claims == held. flagged: claims < held on a pod shown as resyncing / partial_view whose
    ring cannot hold its history (`history` batches since its cache was last empty > `ring`).
    flagged_needlessly: the same, but the ring holds it all (the rule owes exactness). divergent: a claimed block the engine does not hold, or a missing one on a
    pod that is not flagged (or not listed at all). unseen: a pod kvindex does not list that it could not
    have heard of (`unseeable`: bind mode, where a pod exists for kvindex only once one of its batches
    arrives, and every batch since kvindex or the engine or its link last came up left before the
    engine's PUB could have had kvindex's subscription)."""
    extra = len(claims - held)
    missing = len(held - claims)
    flagged = state in FLAGGED_STATES or partial_view
    outcome: PodOutcome
    if not extra and not missing:
        outcome = "exact"
    elif state is None and unseeable:
        outcome = "unseen"
    elif not extra and flagged:
        outcome = "flagged" if history > ring else "flagged_needlessly"
    else:
        outcome = "divergent"
    return PodVerdict(
        engine=engine,
        outcome=outcome,
        held=len(held),
        claimed=len(claims),
        extra=extra,
        missing=missing,
        state=state,
        partial_view=partial_view,
        history=history,
        ring=ring,
    )


def worst(outcomes: Iterable[str]) -> str:
    return max(outcomes, key=OUTCOME_ORDER.index, default="exact")


def is_failure(outcome: str) -> bool:
    """What the tests refuse: anything the rule does not allow."""
    return outcome in ("flagged_needlessly", "divergent", "error")
