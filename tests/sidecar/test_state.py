"""The sidecar's block set against a reference written from the event rules (stored adds a copy,
removed drops one, cleared empties the rank), and its snapshot form."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from kvindex.indexer.snapshot import TierBlocks
from kvindex.sidecar.state import PodBlocks

keys = st.lists(st.integers(0, 6), min_size=1, max_size=3)
tiers = st.sampled_from(["GPU", "CPU"])
events = st.one_of(
    st.builds(lambda k, t: BlocksStored(tuple(k), None, (), 16, tier=t), keys, tiers),
    st.builds(lambda k, t: BlocksRemoved(tuple(k), tier=t), keys, tiers),
    st.just(AllBlocksCleared()),
)


@given(st.lists(st.tuples(st.integers(0, 1), events), max_size=40))
def test_block_set_follows_the_event_rules(stream: list[tuple[int, KVEvent]]) -> None:
    reference: dict[tuple[int, str, int], int] = {}
    state = PodBlocks()
    for rank, event in stream:
        state.rank(rank).apply([event])
        if isinstance(event, BlocksStored):
            for key in event.block_keys:
                reference[(rank, event.tier, key)] = reference.get((rank, event.tier, key), 0) + 1
        elif isinstance(event, BlocksRemoved):
            for key in event.block_keys:
                held = reference.get((rank, event.tier, key), 0)
                if held > 1:
                    reference[(rank, event.tier, key)] = held - 1
                else:
                    reference.pop((rank, event.tier, key), None)
        else:
            reference = {k: v for k, v in reference.items() if k[0] != rank}
    got = {
        (rank, tier.tier, key): (tier.copies[i] if tier.copies else 1)
        for rank in (0, 1)
        for tier in state.rank(rank).tier_blocks()
        for i, key in enumerate(tier.block_hashes)
    }
    assert got == reference
    assert state.num_blocks() == len(reference)


def test_snapshot_form_lists_tiers_by_name_in_first_stored_order() -> None:
    state = PodBlocks()
    state.rank(0).apply(
        [BlocksStored((5, 3), None, (), 16, tier="GPU"), BlocksStored((9,), None, (), 16, tier="CPU")]
    )
    assert state.rank(0).tier_blocks() == [TierBlocks("CPU", [9]), TierBlocks("GPU", [5, 3])]
    state.rank(0).apply([BlocksStored((3,), None, (), 16)])
    assert state.rank(0).tier_blocks()[1] == TierBlocks("GPU", [5, 3], [1, 2])
