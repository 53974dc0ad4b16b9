from collections.abc import Callable

from kvindex.indexer.events import PodRef
from kvindex.indexer.status import HealthReader, PodHealth

def encode_scores(
    holder_ids: list[tuple[int, ...]],
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
