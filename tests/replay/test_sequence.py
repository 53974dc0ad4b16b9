"""The sequence watermark against a model of vLLM's publisher: seqs per process from 0, a ring of the last
N batches, no epoch. Table tests for each rule, then hypothesis streams with drops, duplicates,
reordering and restarts compared with what the engine actually published."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.replay.sequence import Apply, ClearPod, FetchReplay, ReplayedItem, SequenceTracker

Item = tuple[int, int]  # (engine epoch, seq): what the engine really published


class Engine:
    """vLLM's ZmqEventPublisher as the rules state it: seq from 0 per process, ring of buffer_steps."""

    def __init__(self, buffer_steps: int) -> None:
        self.buffer_steps = buffer_steps
        self.epoch = 0
        self.next_seq = 0
        self.ring: deque[Item] = deque(maxlen=buffer_steps)
        self.replay_works = True

    def publish(self) -> Item:
        item = (self.epoch, self.next_seq)
        self.next_seq += 1
        self.ring.append(item)
        return item

    def restart(self) -> None:
        self.epoch += 1
        self.next_seq = 0
        self.ring = deque(maxlen=self.buffer_steps)

    def replay(self, start_seq: int) -> tuple[list[ReplayedItem[Item]], bool]:
        if not self.replay_works:
            return [], False
        return [ReplayedItem(s, (e, s), digest(e, s)) for e, s in self.ring if s >= start_seq], True


def digest(epoch: int, seq: int) -> int:
    return epoch * 1_000_003 + seq


class Driver:
    """Performs the tracker's actions the way the ingest worker does; `view` is the applied stream."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tracker: SequenceTracker[Item] = SequenceTracker()
        self.view: list[Item] = []
        self.clears: list[str] = []
        self.fetches: list[FetchReplay] = []

    def run(self, actions: list) -> None:  # type: ignore[type-arg]
        while actions:
            next_actions: list = []  # type: ignore[type-arg]
            for action in actions:
                if isinstance(action, Apply):
                    self.view.append(action.item)
                elif isinstance(action, ClearPod):
                    self.clears.append(action.reason)
                    self.view.clear()
                elif isinstance(action, FetchReplay):
                    self.fetches.append(action)
                    replayed, complete = self.engine.replay(action.start_seq)
                    next_actions = self.tracker.on_replay(replayed, complete)
            actions = next_actions

    def live(self, item: Item) -> None:
        self.run(self.tracker.on_live(item[1], item, digest(*item)))


def started(buffer_steps: int = 100) -> tuple[Engine, Driver]:
    engine = Engine(buffer_steps)
    driver = Driver(engine)
    driver.run(driver.tracker.begin_join())
    return engine, driver


def test_in_order_stream_is_applied_as_is() -> None:
    engine, driver = started()
    for _ in range(5):
        driver.live(engine.publish())
    assert driver.view == [(0, s) for s in range(5)]
    assert driver.fetches == [FetchReplay(0, "join")]
    assert not driver.tracker.resyncing and not driver.tracker.partial_view


def test_late_join_merges_ring_and_live_without_duplicates() -> None:
    engine = Engine(100)
    for _ in range(4):
        engine.publish()
    driver = Driver(engine)
    first_live = engine.publish()
    driver.live(first_live)  # first contact: join replay from 0 returns 0..4
    driver.live(engine.publish())
    assert driver.view == [(0, s) for s in range(6)]
    assert driver.tracker.num_duplicates == 1
    assert not driver.tracker.partial_view


def test_late_join_after_ring_overflow_is_a_partial_view() -> None:
    engine = Engine(3)
    for _ in range(6):
        engine.publish()
    driver = Driver(engine)
    driver.run(driver.tracker.begin_join())
    assert driver.view == [(0, 3), (0, 4), (0, 5)]
    assert driver.tracker.partial_view and not driver.tracker.resyncing
    assert driver.clears == []


def test_gap_is_filled_from_the_ring_in_order() -> None:
    engine, driver = started()
    driver.live(engine.publish())
    engine.publish()
    engine.publish()
    driver.live(engine.publish())
    assert driver.view == [(0, s) for s in range(4)]
    assert driver.fetches[-1] == FetchReplay(0, "gap")  # from last_applied, to check its digest
    assert driver.tracker.num_gaps == 1


def test_duplicate_after_replay_is_skipped() -> None:
    engine, driver = started()
    items = [engine.publish() for _ in range(3)]
    driver.live(items[0])
    driver.live(items[2])  # gap -> replay brings 1, 2
    driver.live(items[1])  # the delayed live copy
    assert driver.view == items
    assert driver.tracker.num_duplicates >= 1


def test_seq_zero_after_later_ones_is_a_restart() -> None:
    engine, driver = started()
    for _ in range(3):
        driver.live(engine.publish())
    engine.restart()
    driver.live(engine.publish())
    assert driver.clears == ["restart"]
    assert driver.view == [(1, 0)]
    assert driver.tracker.num_restarts == 1


def test_restart_seen_only_through_an_old_seq_is_verified_against_the_ring() -> None:
    engine, driver = started(buffer_steps=1000)
    for _ in range(300):  # beyond the remembered digests
        driver.live(engine.publish())
    engine.restart()
    engine.publish()
    driver.live(engine.publish())  # seq 1 of the new engine; seq 0 lost
    assert driver.clears == ["restart"]
    assert driver.view == [(1, 0), (1, 1)]


def test_restart_with_higher_seqs_is_caught_by_the_digest_of_last_applied() -> None:
    engine, driver = started()
    for _ in range(3):
        driver.live(engine.publish())
    engine.restart()
    for _ in range(5):
        engine.publish()
    driver.live(engine.publish())  # seq 5 looks like a gap after 2; the ring's seq 2 differs
    assert driver.clears == ["restart"]
    assert driver.view == [(1, s) for s in range(6)]


def test_gap_older_than_the_ring_clears_and_resyncs() -> None:
    engine, driver = started(buffer_steps=3)
    driver.live(engine.publish())
    for _ in range(5):
        engine.publish()
    driver.live(engine.publish())
    assert driver.clears == ["history_lost"]
    assert driver.view == [(0, 4), (0, 5), (0, 6)]
    assert driver.tracker.resyncing
    driver.tracker.view_complete()
    assert not driver.tracker.resyncing


def test_failed_replay_on_a_gap_is_lost_history_not_silence() -> None:
    engine, driver = started()
    driver.live(engine.publish())
    engine.publish()
    engine.replay_works = False
    driver.live(engine.publish())
    assert driver.clears == ["history_lost"]
    assert driver.view == [(0, 2)]
    assert driver.tracker.resyncing


def test_quiet_probe_recovers_a_lost_tail() -> None:
    engine, driver = started()
    driver.live(engine.publish())
    engine.publish()
    engine.publish()
    driver.run(driver.tracker.begin_probe())
    assert driver.view == [(0, 0), (0, 1), (0, 2)]
    assert driver.fetches[-1] == FetchReplay(0, "probe")


def test_quiet_probe_detects_a_silent_restart() -> None:
    engine, driver = started()
    for _ in range(4):
        driver.live(engine.publish())
    engine.restart()
    engine.publish()
    driver.run(driver.tracker.begin_probe())  # ring's newest seq 0 < last applied 3
    assert driver.clears == ["restart"]
    assert driver.view == [(1, 0)]


def test_probe_with_nothing_new_changes_nothing() -> None:
    engine, driver = started()
    for _ in range(2):
        driver.live(engine.publish())
    driver.run(driver.tracker.begin_probe())
    assert driver.view == [(0, 0), (0, 1)] and driver.clears == []


def test_live_items_arriving_while_a_replay_is_out_are_held_and_merged() -> None:
    engine = Engine(100)
    tracker: SequenceTracker[Item] = SequenceTracker()
    assert tracker.begin_join() == [FetchReplay(0, "join")]
    items = [engine.publish() for _ in range(4)]
    assert tracker.on_live(2, items[2], digest(*items[2])) == []
    assert tracker.on_live(3, items[3], digest(*items[3])) == []
    ring = [ReplayedItem(s, (0, s), digest(0, s)) for s in range(3)]
    actions = tracker.on_replay(ring, True)
    assert [a.seq for a in actions if isinstance(a, Apply)] == [0, 1, 2, 3]


# -- randomized: the applied view always equals what the engine holds (or is flagged) ---------------

steps = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.booleans()),
        st.tuples(st.just("dup"), st.integers(0, 50)),
        st.tuples(st.just("swap"), st.booleans()),
        st.tuples(st.just("restart"), st.booleans()),
        st.tuples(st.just("probe"), st.booleans()),
        st.tuples(st.just("reconnect"), st.booleans()),
        st.tuples(st.just("replay_down"), st.booleans()),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(buffer_steps=st.sampled_from([2, 4, 1000]), program=steps, late=st.integers(0, 5))
def test_random_streams_match_the_engine(buffer_steps: int, program: list, late: int) -> None:  # type: ignore[type-arg]
    engine = Engine(buffer_steps)
    for _ in range(late):
        engine.publish()
    driver = Driver(engine)
    delivered: list[Item] = []
    ever_lost = late > buffer_steps
    for op, arg in program:
        if op == "publish":
            item = engine.publish()
            if arg:
                delivered.append(item)
                driver.live(item)
        elif op == "dup" and delivered:
            item = delivered[-1 - arg % len(delivered)]
            if item[0] == engine.epoch:
                driver.live(item)
        elif op == "swap":
            first, second = engine.publish(), engine.publish()
            driver.live(second)
            driver.live(first)
        elif op == "restart":
            # A new engine process means a new TCP connection: the subscriber reports a reconnect.
            engine.restart()
            delivered = []
            driver.run(driver.tracker.on_reconnect())
        elif op == "reconnect":
            driver.run(driver.tracker.on_reconnect())
        elif op == "probe":
            driver.run(driver.tracker.begin_probe())
        elif op == "replay_down":
            engine.replay_works = arg
            ever_lost = ever_lost or not arg
        # At every step: one engine's batches, in order, without holes. (Without a replay socket a
        # restarted engine whose seqs continue ours cannot be told apart: vLLM has no epoch.)
        seqs = [s for _, s in driver.view]
        assert len({epoch for epoch, _ in driver.view}) <= 1 or ever_lost
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
    engine.replay_works = True
    driver.run(driver.tracker.begin_join())
    driver.run(driver.tracker.begin_probe())

    truth = list(engine.ring) if engine.next_seq else []
    full = [(engine.epoch, s) for s in range(engine.next_seq)]
    view = driver.view
    # Never an old engine's batch, never out of order, always up to the newest batch.
    assert all(epoch == engine.epoch for epoch, _ in view)
    assert [s for _, s in view] == sorted({s for _, s in view})
    if view:
        assert view[-1] == full[-1]
        assert view == full[view[0][1] :], "the view has a hole"
    else:
        assert not full
    if view != full:
        # Something was lost and the tracker says so.
        assert driver.tracker.resyncing or driver.tracker.partial_view
        assert len(full) > buffer_steps or ever_lost
    if buffer_steps == 1000 and not ever_lost:
        assert view == full
    assert set(truth) <= set(view) or driver.tracker.resyncing or driver.tracker.partial_view


def test_restart_continuing_our_seqs_is_caught_after_the_reconnect() -> None:
    engine, driver = started()
    driver.live(engine.publish())  # (0, 0)
    engine.restart()
    driver.run(driver.tracker.on_reconnect())
    engine.publish()
    driver.live(engine.publish())  # (1, 1) looks like the next seq; the ring's seq 0 differs
    assert driver.clears == ["restart"]
    assert driver.view == [(1, 0), (1, 1)]


def test_reconnect_to_the_same_engine_changes_nothing() -> None:
    engine, driver = started()
    driver.live(engine.publish())
    driver.run(driver.tracker.on_reconnect())
    driver.live(engine.publish())
    assert driver.clears == [] and driver.view == [(0, 0), (0, 1)]


def test_restart_whose_ring_skips_last_applied_is_not_stitched_onto_the_old_stream() -> None:
    engine, driver = started(buffer_steps=2)
    driver.live(engine.publish())  # (0, 0)
    engine.restart()
    driver.run(driver.tracker.on_reconnect())
    engine.publish()
    engine.publish()
    driver.live(engine.publish())  # (1, 2): the ring holds (1, 1), (1, 2) and cannot vouch for seq 0
    assert all(epoch == 1 for epoch, _ in driver.view)
    assert driver.view == [(1, 1), (1, 2)]
    # The reconnect check found the restart at once (empty ring: cleared, rejoined with nothing), so the
    # lost seq 0 is a late join's partial view rather than a resync.
    assert driver.tracker.partial_view or driver.tracker.resyncing


# -- found by the fuzzer (benchmarks/fuzz.py) -------------------------------------------------------------


def test_batches_let_go_with_a_hole_are_not_negative_duplicates() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replayable=False)
    tracker.on_replay_unavailable()
    tracker.begin_join()
    tracker.on_replay_unavailable()  # joined with nothing
    for seq in range(3):
        tracker.on_live(seq, "b", seq)
    tracker.on_live(10, "b", 10)  # a jump: held, a replay asked for
    for seq in (11, 12, 20):
        tracker.on_live(seq, "b", seq)
    actions = tracker.on_replay_unavailable()
    assert [a.seq for a in actions if isinstance(a, Apply)] == [20]  # only the run after the last hole
    assert ClearPod("history_lost") in actions
    assert tracker.num_duplicates == 0 and tracker.num_held_dropped == 3


def test_without_a_replay_socket_a_seq_that_goes_back_is_a_restart() -> None:
    """Nothing can be verified, and a restarted engine's seqs from 0 must not be taken for stale copies
    once the old ones have left the digest window."""
    tracker: SequenceTracker[tuple[int, int]] = SequenceTracker(replayable=False)
    tracker.begin_join()
    tracker.on_replay_unavailable()
    for seq in range(300):
        tracker.on_live(seq, (0, seq), digest(0, seq))
    actions = tracker.on_live(0, (1, 0), digest(1, 0))
    assert actions == [ClearPod("restart"), Apply(0, (1, 0))]
    # With a replay socket the same seq is checked against the ring instead, once.
    checked: SequenceTracker[tuple[int, int]] = SequenceTracker()
    checked.begin_join()
    checked.on_replay([], True)
    for seq in range(300):
        checked.on_live(seq, (0, seq), digest(0, seq))
    assert checked.on_live(0, (1, 0), digest(1, 0)) == [FetchReplay(299, "verify")]


def test_held_batches_are_bounded_in_bytes() -> None:
    tracker: SequenceTracker[int] = SequenceTracker(max_held_bytes=1000)
    assert tracker.begin_join() == [FetchReplay(0, "join")]
    for seq in range(50):
        assert tracker.on_live(seq, seq, seq, size=100) == []  # held: the join is out
    assert tracker.num_held_dropped == 40
    ring = [ReplayedItem(seq, seq, seq) for seq in range(40, 50)]  # a ring of 10 that overflowed
    actions = tracker.on_replay(ring, True)
    assert [a.seq for a in actions if isinstance(a, Apply)] == list(range(40, 50))
    assert tracker.partial_view


def test_an_old_engines_batches_queued_behind_the_reconnection_are_not_stitched_on() -> None:
    """ZMQ reports the new connection before the old one's last messages are read: after the reconnect
    check the old engine's seqs 6..9 still arrive, among the new engine's. Found by the soak benchmark
    (a restart counted twice and the dead engine's blocks back in the index)."""
    engine, driver = started()
    for _ in range(6):
        driver.live(engine.publish())  # (0, 0..5) applied
    old_tail = [engine.publish() for _ in range(4)]  # (0, 6..9): still queued in kvindex
    engine.restart()
    new = [engine.publish() for _ in range(3)]  # (1, 0..2) in the new engine's ring
    actions = driver.tracker.on_reconnect()  # the check goes out; everything live is held meanwhile
    for item in old_tail:
        driver.live(item)
    driver.live(engine.publish())  # (1, 3), live, after the old tail
    driver.run(actions)
    assert driver.clears == ["restart"]
    assert driver.view == [*new, (1, 3)]
    assert driver.tracker.num_restarts == 1 and not driver.tracker.resyncing


def test_held_batches_below_an_unprovable_ring_are_not_stitched_onto_it() -> None:
    """The engine restarts while a gap replay is out, and its new ring (3 batches) starts past what we
    applied, so nothing proves whose the held live batches are. The old engine's seqs 3..6 were held and
    run without a hole into the new ring's 7..9: they must not be applied (found by the fault harness,
    seed 101634: the dead engine's blocks claimed, state resyncing)."""
    engine, driver = started(buffer_steps=3)
    for _ in range(3):
        driver.live(engine.publish())  # (0, 0..2) applied
    old_tail = [engine.publish() for _ in range(4)]  # (0, 3..6)
    tracker = driver.tracker
    gap = tracker.on_live(old_tail[1][1], old_tail[1], digest(*old_tail[1]))  # 4 first: a gap from 2
    assert gap == [FetchReplay(2, "gap")]
    for item in (old_tail[0], old_tail[2], old_tail[3]):
        assert tracker.on_live(item[1], item, digest(*item)) == []  # held while the replay is out
    engine.restart()
    new = [engine.publish() for _ in range(10)]  # (1, 0..9); the ring keeps 7..9
    driver.view.clear()
    driver.run(gap)  # answered by the new engine
    assert driver.clears == ["history_lost"]
    assert driver.view == new[7:]
    assert tracker.resyncing


def test_a_join_answered_by_a_restarted_engine_leaves_the_old_engines_held_batches_out() -> None:
    """Joining (nothing applied yet), the old engine's last batches 5..6 are held; the engine restarts and
    its ring (3 batches) holds 7..9, run on from them without a hole. The join applies the ring's only."""
    engine = Engine(buffer_steps=3)
    driver = Driver(engine)
    old = [engine.publish() for _ in range(7)]  # (0, 0..6)
    join = driver.tracker.begin_join()
    for item in old[5:]:
        assert driver.tracker.on_live(item[1], item, digest(*item)) == []  # held while the join is out
    engine.restart()
    new = [engine.publish() for _ in range(10)]  # (1, 0..9); the ring keeps 7..9
    driver.run(join)
    assert driver.view == new[7:]
    assert driver.tracker.partial_view


def test_a_restart_whose_first_surviving_batch_is_our_next_seq_is_caught_by_the_connections_check() -> None:
    """Bind mode: the restarted engine's seqs 0..3 reached nobody and its seq 4 is exactly the next one we
    expect, so it is applied; the probe after the connection compares the ring from before our last seq
    and finds other batches there (found by the fault harness, seed 100039: the dead engine's blocks
    claimed, state live)."""
    engine, driver = started()
    for _ in range(4):
        driver.live(engine.publish())  # (0, 0..3)
    engine.restart()
    for _ in range(4):
        engine.publish()  # (1, 0..3): lost
    driver.tracker.mark_unverified()  # the connection
    driver.live(engine.publish())  # (1, 4)
    driver.run(driver.tracker.begin_probe())
    assert driver.clears == ["restart"]
    assert driver.view == [(1, s) for s in range(5)]
    # The same engine: the probe's wider comparison changes nothing, and the next probe is plain again.
    engine2, same = started()
    for _ in range(12):
        same.live(engine2.publish())
    same.tracker.mark_unverified()
    same.live(engine2.publish())
    same.run(same.tracker.begin_probe())
    assert same.clears == [] and same.fetches[-1] == FetchReplay(3, "probe")
    assert same.tracker.begin_probe() == [FetchReplay(12, "probe")]
