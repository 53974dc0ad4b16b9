"""The pod's block set as its sidecar holds it: per DP rank and tier, each block key with its copy count,
in first-stored order. Pure: the relay applies every batch it forwards, in downstream order, so the set
at downstream seq N is what a consumer that applied seqs 0..N would hold.

The rules are the index's (indexer/index.py): BlocksStored adds a copy (up to MAX_COPIES), BlocksRemoved
drops one and the block with its last, AllBlocksCleared empties the rank on every tier."""

from __future__ import annotations

from collections.abc import Iterable

from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from kvindex.indexer.index import MAX_COPIES
from kvindex.indexer.snapshot import TierBlocks


class RankBlocks:
    """One DP rank's blocks: tier -> block key -> copies."""

    __slots__ = ("tiers",)

    def __init__(self) -> None:
        self.tiers: dict[str, dict[int, int]] = {}

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if type(event) is BlocksStored:
                held = self.tiers.get(event.tier)
                if held is None:
                    held = self.tiers[event.tier] = {}
                for key in event.block_keys:
                    held[key] = min(MAX_COPIES, held.get(key, 0) + 1)
            elif type(event) is BlocksRemoved:
                held = self.tiers.get(event.tier)
                if held is None:
                    continue
                for key in event.block_keys:
                    copies = held.get(key)
                    if copies is None:
                        continue
                    if copies > 1:
                        held[key] = copies - 1
                    else:
                        del held[key]
            elif type(event) is AllBlocksCleared:
                self.tiers.clear()

    def clear(self) -> None:
        self.tiers.clear()

    def num_blocks(self) -> int:
        """(block, tier) pairs held."""
        return sum(len(held) for held in self.tiers.values())

    def tier_blocks(self) -> list[TierBlocks]:
        """The snapshot form, tiers by name (copy counts only when some block is held more than once)."""
        out = []
        for tier in sorted(self.tiers):
            held = self.tiers[tier]
            if not held:
                continue
            copies = list(held.values())
            out.append(TierBlocks(tier, list(held), copies if any(c > 1 for c in copies) else []))
        return out


class PodBlocks:
    """Every DP rank's blocks of one pod."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankBlocks] = {}

    def rank(self, dp_rank: int) -> RankBlocks:
        blocks = self.ranks.get(dp_rank)
        if blocks is None:
            blocks = self.ranks[dp_rank] = RankBlocks()
        return blocks

    def num_blocks(self) -> int:
        return sum(blocks.num_blocks() for blocks in self.ranks.values())
