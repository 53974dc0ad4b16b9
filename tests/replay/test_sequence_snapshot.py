"""The sequence tracker's snapshot path (a stream whose publisher is a sidecar serving its state at a
seq): a join and a gap older than the ring load the snapshot instead of clearing; batches held meanwhile
follow it; a failed load falls back to the replay path once, flagged as without a snapshot."""

from __future__ import annotations

from kvindex.replay.sequence import (
    CHECK_MARGIN,
    Apply,
    ClearPod,
    FetchReplay,
    FetchSnapshot,
    ReplayedItem,
    SequenceTracker,
)


def ring(seqs: range) -> list[ReplayedItem[int]]:
    return [ReplayedItem(s, s, s) for s in seqs]


def applied(actions: list[object]) -> list[int]:
    return [a.seq for a in actions if isinstance(a, Apply)]


def test_join_loads_the_snapshot_and_the_held_batches_after_it_follow() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    assert tracker.on_live(40, 40, 40) == [FetchSnapshot("join")]
    assert tracker.on_live(41, 41, 41) == [] and tracker.on_live(42, 42, 42) == []
    actions = tracker.on_snapshot(40)
    assert applied(actions) == [41, 42] and not any(isinstance(a, ClearPod) for a in actions)
    assert tracker.joined and not tracker.partial_view and not tracker.resyncing
    assert tracker.on_live(43, 43, 43) == [Apply(43, 43)]
    assert tracker.num_duplicates == 1  # seq 40: in the snapshot already


def test_a_hole_between_the_snapshot_and_the_held_batches_is_replayed_from_the_snapshots_seq() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    tracker.begin_join()
    tracker.on_live(45, 45, 45)
    assert tracker.on_snapshot(40) == [FetchReplay(40, "gap")]
    actions = tracker.on_replay(ring(range(30, 46)), complete=True)
    assert applied(actions) == [41, 42, 43, 44, 45]
    assert not tracker.resyncing and not tracker.partial_view


def test_a_gap_older_than_the_ring_loads_the_snapshot_instead_of_clearing() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    tracker.begin_join()
    tracker.on_snapshot(None)
    assert applied(tracker.on_live(0, 0, 0)) == [0]
    assert tracker.on_live(100, 100, 100) == [FetchReplay(0, "gap")]
    actions = tracker.on_replay(ring(range(80, 101)), complete=True)  # the ring lost 1..79
    assert actions == [FetchSnapshot("history_lost")] and tracker.num_history_lost == 1
    tracker.on_live(101, 101, 101)
    actions = tracker.on_snapshot(100)
    assert applied(actions) == [101] and not any(isinstance(a, ClearPod) for a in actions)
    assert not tracker.resyncing and not tracker.partial_view


def test_a_failed_snapshot_falls_back_to_the_ring_once_then_is_tried_again() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    tracker.begin_join()
    tracker.on_snapshot(None)
    tracker.on_live(0, 0, 0)
    tracker.on_live(100, 100, 100)
    tracker.on_replay(ring(range(80, 101)), complete=True)
    assert tracker.on_snapshot_failed() == [FetchReplay(0, "gap")] and tracker.needs_check
    actions = tracker.on_replay(ring(range(80, 101)), complete=True)
    assert actions == [ClearPod("history_lost"), *(Apply(s, s) for s in range(80, 101))]
    assert tracker.resyncing  # replay-and-flag, as without a snapshot
    assert tracker.begin_probe() == [FetchSnapshot("resync")]  # the next check tries the snapshot again
    assert tracker.on_snapshot(100) == [] and not tracker.resyncing


def test_a_failed_join_snapshot_joins_from_the_ring_and_a_partial_source_stays_flagged() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    tracker.begin_join()
    assert tracker.on_snapshot_failed() == [FetchReplay(0, "join")]
    assert applied(tracker.on_replay(ring(range(5, 8)), complete=True)) == [5, 6, 7]
    assert tracker.partial_view  # joined late from the ring, as without a snapshot
    other: SequenceTracker[int] = SequenceTracker(snapshot=True)
    other.begin_join()
    other.on_snapshot(7, partial=True)
    assert other.partial_view and not other.resyncing


def test_a_restarted_sidecar_is_joined_through_its_snapshot() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(snapshot=True)
    tracker.begin_join()
    tracker.on_snapshot(50)
    assert tracker.on_reconnect() == [FetchReplay(50 - CHECK_MARGIN, "reconnect")]
    actions = tracker.on_replay(ring(range(0, 10)), complete=True)  # its newest seq is below ours
    assert actions == [ClearPod("restart"), FetchSnapshot("join")] and tracker.num_restarts == 1


def test_without_snapshot_nothing_changes() -> None:
    tracker: SequenceTracker[int] = SequenceTracker()
    assert tracker.begin_join() == [FetchReplay(0, "join")]
    assert tracker.on_snapshot(3) == [] and tracker.on_snapshot_failed() == []
