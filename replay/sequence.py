"""Stage 4 of the write path: the per-stream sequence watermark (one (pod, dp rank) publisher).

Pure and sans-IO: the ingest worker feeds it live messages and replay replies, and it answers with
actions (apply this batch, clear the pod's entries, fetch a replay from seq N) that the worker performs.
Each item carries a payload digest so a restarted engine (vLLM has no epoch) is told from a duplicate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Literal, TypeVar

import msgspec

T = TypeVar("T")

# Digests of the most recently applied seqs kept for duplicate/restart decisions.
RECENT_DIGESTS = 256
# Replay attempts for one request before the tracker goes on without its answer (the shell spaces them
# with a capped backoff; a failed attempt proves nothing about the engine).
MAX_REPLAY_ATTEMPTS = 5
# Live batches held while a replay is out; beyond this count or these bytes the oldest are let go (a
# replay that succeeds brings them back from the ring, which holds vLLM's last 10,000 batches by default).
MAX_HELD = 10_000
MAX_HELD_BYTES = 64 << 20
# A (re)connection's check compares the ring with what we applied from this many batches before our last
# seq: the poller may hand over a new connection's first batches before its monitor event, and a restarted
# engine whose first batches were lost can deliver exactly our next seq.
CHECK_MARGIN = 8

ClearReason = Literal["restart", "history_lost", "resync"]
ReplayPurpose = Literal["join", "gap", "verify", "reconnect", "probe"]
SnapshotPurpose = Literal["join", "history_lost", "resync"]


class Apply(msgspec.Struct, Generic[T], frozen=True):
    """Apply this batch to the index now (actions come in seq order)."""

    seq: int
    item: T


class ClearPod(msgspec.Struct, frozen=True):
    """Drop every index entry of this stream before applying what follows."""

    reason: ClearReason


class FetchReplay(msgspec.Struct, frozen=True):
    """Ask the stream's replay socket for every batch with seq >= start_seq, then call `on_replay`.

    Always the last action of a list; live items arriving meanwhile are held by the tracker. `attempt`
    counts earlier failed tries of the same request (0 for the first): the shell waits before a retry.
    """

    start_seq: int
    purpose: ReplayPurpose
    attempt: int = 0


class FetchSnapshot(msgspec.Struct, frozen=True):
    """Load the stream's snapshot (a sidecar's state and the seq it reflects), then call `on_snapshot`
    (or `on_snapshot_failed`). Only for streams built with `snapshot=True`; like FetchReplay, always the
    last action of a list, and live items arriving meanwhile are held."""

    purpose: SnapshotPurpose


Action = Apply[T] | ClearPod | FetchReplay | FetchSnapshot


class ReplayedItem(msgspec.Struct, Generic[T], frozen=True):
    seq: int
    item: T
    digest: int


class SequenceTracker(Generic[T]):
    """Orders one stream's batches: apply next, skip duplicates, repair gaps, detect restarts.

    Contract (all seqs are vLLM's per-publisher counter, 0, 1, 2, ...; vLLM has no epoch):
    - First contact asks for a replay from seq 0 (late join); the replay and the live stream are merged.
    - seq == last_applied + 1: applied at once.
    - A seq already applied with the same digest: duplicate, skipped (normal right after a replay).
      The same seq with another digest: the engine restarted (clear, rejoin from 0).
    - A seq older than the remembered digests: verified against the replay socket from last_applied;
      once that proved the engine the same, later ones are stale copies skipped without a replay, until
      the next (re)connection.
    - A (re)connection of the transport (`on_reconnect`) asks the ring from last_applied whatever the
      live seqs are: the ring's newest seq below last_applied, or other content at last_applied, is a
      restarted engine (clear, rejoin from 0), whether its new seqs are fewer or more than ours.
    - A jump: replay from last_applied (its digest proves the engine is the same), merged with the held
      live batches. If the ring no longer holds last_applied, the missing batches are lost: clear the
      pod, apply what exists, and set `resyncing`.
    - A replay that fails (timeout, no answer) proves nothing: it is asked again (`attempt` + 1) up to
      MAX_REPLAY_ATTEMPTS; then the tracker goes on with what it holds, never clearing on the failure
      itself (a gap it cannot fill is lost history), and sets `needs_check` for the shell to probe later.
    - `resyncing` and `partial_view` end when the view is complete again: after an AllBlocksCleared
      (the shell calls `view_complete()`), or when a probe finds the ring still starting at seq 0 (the
      whole history: clear and apply it all, reason "resync").
    - With `snapshot=True` (the publisher is a sidecar serving its state at a seq) a join, and a gap the
      ring no longer covers, load the snapshot instead (FetchSnapshot): the shell replaces the stream's
      entries with it and calls `on_snapshot(seq)`, the held live batches after seq follow. The view is
      then exact, not flagged. A snapshot that cannot be loaded (`on_snapshot_failed`) falls back to the
      replay path once (join from the ring, or clear and apply the tail, flagged); a flagged stream's
      next probe tries the snapshot again.
    """

    # Slots: a score answer reads joined and resyncing of ~200 trackers (first: one cache line).
    __slots__ = (
        "joined",
        "resyncing",
        "replayable",
        "snapshot",
        "_skip_snapshot",
        "_max_held_bytes",
        "last_applied",
        "partial_view",
        "awaiting",
        "needs_check",
        "num_duplicates",
        "num_gaps",
        "num_restarts",
        "num_history_lost",
        "num_held_dropped",
        "_recent",
        "_held",
        "_held_sizes",
        "_held_bytes",
        "_verified",
        "_recheck",
        "_ring_overflowed",
        "_check_from",
        "_connections",
        "_fetch_connections",
    )

    def __init__(
        self, *, replayable: bool = True, max_held_bytes: int = MAX_HELD_BYTES, snapshot: bool = False
    ) -> None:
        """`replayable`: the stream has a replay socket. Without one nothing can be verified, so a seq
        that goes back with an unknown digest is taken for a restarted engine rather than a stale copy.
        `snapshot`: the stream's state can be loaded at a seq (FetchSnapshot)."""
        self.replayable = replayable
        self.snapshot = snapshot
        # The last snapshot could not be loaded: the next join or lost gap takes the replay path.
        self._skip_snapshot = False
        self._max_held_bytes = max_held_bytes
        self.last_applied: int | None = None
        self.joined = False
        self.resyncing = False
        self.partial_view = False
        self.awaiting: FetchReplay | FetchSnapshot | None = None
        # The shell should probe this stream again soon (a check that could not be made).
        self.needs_check = False
        self.num_duplicates = 0
        self.num_gaps = 0
        self.num_restarts = 0
        self.num_history_lost = 0
        self.num_held_dropped = 0
        self._recent: OrderedDict[int, int] = OrderedDict()
        self._held: dict[int, tuple[T, int]] = {}
        self._held_sizes: dict[int, int] = {}
        self._held_bytes = 0
        # The engine behind the stream was proven the one we follow since the last (re)connection.
        self._verified = False
        # A (re)connection happened while a replay was out: check again once it is answered.
        self._recheck = False
        # The ring no longer starts at seq 0 for this engine: a whole-history resync cannot succeed.
        self._ring_overflowed = False
        # Since a (re)connection: the seq from which the ring must still be compared with what we applied
        # (None: nothing to check). Connections are counted so an answer to a request sent before the
        # latest one does not clear the check it could not make.
        self._check_from: int | None = None
        self._connections = 0
        self._fetch_connections = 0

    # -- inputs ---------------------------------------------------------------------------------

    def begin_join(self) -> list[Action[T]]:
        """First contact (connect mode at start): fetch everything the ring holds."""
        if self.joined or self.awaiting is not None:
            return []
        return [self._join()]

    def begin_probe(self) -> list[Action[T]]:
        """The stream went quiet (or a check is due): ask the ring for batches we never received, for a
        restart, and — while the view is flagged — for the whole history."""
        if self.awaiting is not None:
            return []
        if not self.joined:
            return [self._join()]
        if (self.partial_view or self.resyncing) and self.snapshot:
            return [self._fetch_snapshot("resync")]
        flagged = (self.partial_view or self.resyncing) and not self._ring_overflowed
        start = 0 if self.last_applied is None or flagged else self._check_start(self.last_applied)
        return [self._fetch(start, "probe")]

    def on_reconnect(self) -> list[Action[T]]:
        """The transport (re)connected: the engine behind it may be a new process. Check the ring."""
        self.mark_unverified()
        if self.awaiting is not None:
            self._recheck = True
            return []
        if not self.joined:
            return [self._join()]
        return [
            self._fetch(0 if self.last_applied is None else self._check_start(self.last_applied), "reconnect")
        ]

    def mark_unverified(self) -> None:
        """A connection came that may or may not be this stream's engine (bind mode: ZMQ does not say
        which peer connected): nothing is asked now, but the next seq that is not the expected one is
        checked against the ring rather than trusted, and the next check (a gap, a verify, the quiet
        probe) compares the ring from a little before the seq we had applied: a restarted engine whose
        first batches were lost may have delivered exactly our next seq."""
        self._verified = False
        self._connections += 1
        last = self.last_applied
        if last is not None:
            point = max(0, last - CHECK_MARGIN)
            self._check_from = point if self._check_from is None else min(self._check_from, point)

    def on_live(self, seq: int, item: T, digest: int, size: int = 0) -> list[Action[T]]:
        """A live batch; `size` (its payload bytes) bounds what is held while a replay is out."""
        if self.awaiting is not None:
            self._hold(seq, item, digest, size)
            return []
        if not self.joined:
            self._hold(seq, item, digest, size)
            return [self._join()]
        last = self.last_applied
        if last is not None and seq <= last:
            known = self._recent.get(seq)
            if known == digest or (known is None and self._verified and self.replayable):
                self.num_duplicates += 1
                return []
            if known is not None or not self.replayable:
                actions: list[Action[T]] = [self._restart()]
                return actions + self.on_live(seq, item, digest, size)
            self._hold(seq, item, digest, size)
            return [self._fetch(self._check_start(last), "verify")]
        expected = 0 if last is None else last + 1
        if seq == expected:
            self._mark_applied(seq, digest)
            return [Apply(seq, item)]
        self.num_gaps += 1
        self._hold(seq, item, digest, size)
        return [self._fetch(expected if last is None else self._check_start(last), "gap")]

    def on_replay(self, replayed: Sequence[ReplayedItem[T]], complete: bool) -> list[Action[T]]:
        """The reply to the last FetchReplay: `replayed` in seq order, `complete` = end marker seen.

        An incomplete reply (timeout, no answer) is a failed attempt: the same request again, or after
        MAX_REPLAY_ATTEMPTS the stream goes on with what it holds.
        """
        request = self.awaiting
        if not isinstance(request, FetchReplay):
            return []
        if not complete:
            if request.attempt + 1 < MAX_REPLAY_ATTEMPTS:
                self.awaiting = FetchReplay(request.start_seq, request.purpose, request.attempt + 1)
                return [self.awaiting]
            self.needs_check = True
            return self._settle(request, [], proven=False)
        self.needs_check = False
        actions = self._settle(request, replayed, proven=True)
        if self._recheck and self.awaiting is None:
            self._recheck = False
            last = self.last_applied
            actions.append(self._fetch(0 if last is None else self._check_start(last), "reconnect"))
        return actions

    def on_replay_unavailable(self) -> list[Action[T]]:
        """The stream has no replay socket: go on with what is held (what is missing is lost)."""
        request = self.awaiting
        if not isinstance(request, FetchReplay):
            return []
        return self._settle(request, [], proven=False)

    def begin_snapshot_check(self) -> list[Action[T]]:
        """Load the snapshot now (the shell saw a sign the source's view changed: an AllBlocksCleared
        from a sidecar, which may be its own after it lost history), unless a request is out."""
        if not self.snapshot or self.awaiting is not None or not self.joined:
            return []
        return [self._fetch_snapshot("resync")]

    def on_snapshot(self, seq: int | None, *, partial: bool = False) -> list[Action[T]]:
        """The shell replaced the stream's entries with a snapshot reflecting every batch up to `seq`
        (None: none yet). Held batches after it follow; a hole before them is replayed from `seq`.
        `partial`: the snapshot's source itself lacks part of the history (flagged, not resyncing)."""
        if not isinstance(self.awaiting, FetchSnapshot):
            return []
        self.awaiting = None
        self.joined = True
        self._skip_snapshot = False
        self._reset_view()
        self.partial_view = partial
        self.needs_check = False
        self._verified = True
        self._ring_overflowed = False
        # Its digest is unknown: a replay answering from seq is taken as the same publisher's.
        self.last_applied = seq
        stale = [s for s in self._held if seq is not None and s <= seq]
        for s in stale:
            del self._held[s]
            self._held_bytes -= self._held_sizes.pop(s, 0)
        self.num_duplicates += len(stale)
        pending = sorted(self._held)
        expected = 0 if seq is None else seq + 1
        if pending and (pending[0] != expected or pending[-1] - pending[0] != len(pending) - 1):
            self.num_gaps += 1
            return [self._fetch(0 if seq is None else seq, "gap")]
        actions: list[Action[T]] = []
        for s in pending:
            item, digest = self._held[s]
            self._mark_applied(s, digest)
            actions.append(Apply(s, item))
        self._held = {}
        self._held_sizes = {}
        self._held_bytes = 0
        return actions

    def on_snapshot_failed(self) -> list[Action[T]]:
        """The snapshot could not be loaded: what a stream without one would have done — a join replays
        the ring; a lost gap is asked from the ring again, which clears and applies the tail, flagged.
        The shell is asked to check again later (`needs_check`), which tries the snapshot again."""
        request = self.awaiting
        if not isinstance(request, FetchSnapshot):
            return []
        self.awaiting = None
        self._skip_snapshot = True
        self.needs_check = True
        if not self.joined:
            return [self._fetch(0, "join")]
        if request.purpose == "resync":
            self._skip_snapshot = False
            return []  # still flagged, as before the attempt; the next check tries again
        last = self.last_applied
        return [self._fetch(0 if last is None else self._check_start(last), "gap")]

    def view_complete(self) -> None:
        """The pod's view is whole again (it cleared its cache): leave `resyncing` / `partial_view`."""
        self.resyncing = False
        self.partial_view = False

    # -- internals ------------------------------------------------------------------------------

    def _settle(
        self, request: FetchReplay, replayed: Sequence[ReplayedItem[T]], proven: bool
    ) -> list[Action[T]]:
        """Merge a replay's batches (proven: the ring answered completely) with the held live ones."""
        self.awaiting = None
        self.joined = True
        self._recheck = self._recheck and proven
        skip_snapshot, self._skip_snapshot = self._skip_snapshot, False
        items = [r for r in replayed if r.seq >= request.start_seq]
        if proven:
            self._drop_foreign_held(items, request.start_seq)
        last = self.last_applied
        actions: list[Action[T]] = []
        if proven and last is not None:
            # Every batch the ring shares with what we applied must be the same batch: one that is not
            # is another engine's (a restart), whatever the seqs.
            recent = self._recent
            if any(recent.get(r.seq, r.digest) != r.digest for r in items if r.seq <= last):
                return [self._restart(), self._join()]
            if self._check_from is not None and self._connections == self._fetch_connections:
                if request.start_seq <= self._check_from or not items or items[0].seq > self._check_from:
                    self._check_from = None  # compared as far back as the ring goes
        if proven and request.start_seq == 0 and last is not None:
            if items and items[0].seq == 0:
                if self.partial_view or self.resyncing:
                    # The ring still holds the whole history: rebuild the view from it, exactly.
                    self._reset_view()
                    last = None
                    actions.append(ClearPod("resync"))
            elif items:
                self._ring_overflowed = True
            if last is not None:
                items = [r for r in items if r.seq >= last]
        unverified = False
        if last is not None and proven:
            if items and items[0].seq <= last:
                items = [r for r in items if r.seq > last]
                self._verified = True
            elif items:
                # The ring no longer holds last_applied, so nothing proves these batches come from the
                # engine we were following: treat the gap as lost history. Nor does anything prove whose
                # the held live batches below the ring's oldest are (a restarted engine's ring starts
                # past them too): they are let go rather than stitched onto the ring's run.
                unverified = True
            else:
                # The ring's newest seq is below what we applied: a new engine.
                return [self._restart(), self._join()]
        elif proven and items and items[0].seq > 0:
            self._ring_overflowed = True
        merged: dict[int, tuple[T, int]] = dict(self._held)
        for r in items:
            merged[r.seq] = (r.item, r.digest)
        pending = sorted(seq for seq in merged if last is None or seq > last)
        # Held live copies of replayed batches, and anything at or below last_applied.
        self.num_duplicates += len(self._held) + len(items) - len(pending)
        self._held = {}
        self._held_sizes = {}
        self._held_bytes = 0
        if not pending:
            return actions
        if request.purpose == "probe" and actions == []:
            self.num_gaps += 1
        expected = 0 if last is None else last + 1
        gapless = pending[-1] - pending[0] == len(pending) - 1
        if unverified or not gapless or pending[0] != expected:
            if self.snapshot and not skip_snapshot:
                # The snapshot replaces the lost history: hold what we have, load it, go on after it.
                if last is not None:
                    self.num_history_lost += 1
                self._held = {seq: merged[seq] for seq in pending}
                return actions + [self._fetch_snapshot("history_lost" if last is not None else "join")]
            if last is None and gapless:
                # Joined late: the ring no longer starts at 0. Nothing applied yet, nothing to clear.
                self.partial_view = True
            else:
                self.num_history_lost += 1
                self.resyncing = True
                actions.append(ClearPod("history_lost"))
                # Only the run after the last hole: a batch in a hole may have removed what an earlier
                # batch stored, so nothing before it can be applied safely.
                tail = len(pending) - 1
                while tail > 0 and pending[tail - 1] == pending[tail] - 1:
                    tail -= 1
                self.num_held_dropped += tail  # let go with the hole
                pending = pending[tail:]
        elif last is None:
            self.partial_view = False
            self.resyncing = False
        for seq in pending:
            item, digest = merged[seq]
            self._mark_applied(seq, digest)
            actions.append(Apply(seq, item))
        return actions

    def _drop_foreign_held(self, ring: Sequence[ReplayedItem[T]], start_seq: int) -> None:
        """Let go of held live batches the answering engine cannot have sent. Its own batches are in its
        ring with the ring's digest, or continue the ring's newest seq without a hole; anything else is
        a previous engine's, still queued behind the new connection (ZMQ reports a reconnection before
        the old connection's last messages are read) and must not be stitched onto the new stream.
        Held batches older than the ring's oldest (and newer than last_applied) are let go too: nothing
        proves whose they are, and a restarted engine's ring starts past them just as an overflowed one
        does (seed 101634 applied a dead engine's last batches, run without a hole into the new ring)."""
        if ring:
            newest = ring[-1].seq
        elif start_seq == 0:
            newest = -1  # an empty ring: the engine has published nothing yet
        else:
            return  # nothing at or after start_seq: the caller decides (a restart, asked again from 0)
        digests = {r.seq: r.digest for r in ring}
        expected = newest + 1
        last = self.last_applied
        for seq in sorted(self._held):
            if seq <= newest:
                known = digests.get(seq)
                if known == self._held[seq][1] or (known is None and last is not None and seq <= last):
                    continue
            elif seq == expected:
                expected += 1
                continue
            del self._held[seq]
            self._held_bytes -= self._held_sizes.pop(seq, 0)
            self.num_held_dropped += 1

    def _hold(self, seq: int, item: T, digest: int, size: int) -> None:
        self._held_bytes += size - self._held_sizes.get(seq, 0)
        self._held[seq] = (item, digest)
        self._held_sizes[seq] = size
        while len(self._held) > 1 and (len(self._held) > MAX_HELD or self._held_bytes > self._max_held_bytes):
            oldest = min(self._held)
            del self._held[oldest]
            self._held_bytes -= self._held_sizes.pop(oldest)
            self.num_held_dropped += 1

    def _check_start(self, last: int) -> int:
        """Where a replay from `last` starts: earlier while a connection's check is due."""
        return last if self._check_from is None else min(last, self._check_from)

    def _fetch(self, start_seq: int, purpose: ReplayPurpose) -> FetchReplay:
        request = self.awaiting = FetchReplay(start_seq, purpose)
        self._fetch_connections = self._connections
        return request

    def _fetch_snapshot(self, purpose: SnapshotPurpose) -> FetchSnapshot:
        request = self.awaiting = FetchSnapshot(purpose)
        return request

    def _join(self) -> FetchReplay | FetchSnapshot:
        """First contact: the snapshot when there is one (unless the last could not be loaded), else
        everything the ring holds."""
        if self.snapshot and not self._skip_snapshot:
            return self._fetch_snapshot("join")
        return self._fetch(0, "join")

    def _reset_view(self) -> None:
        self.last_applied = None
        self._check_from = None
        self.resyncing = False
        self.partial_view = False
        self._recent.clear()

    def _restart(self) -> ClearPod:
        self.num_restarts += 1
        self._reset_view()
        self._verified = False
        self._ring_overflowed = False
        return ClearPod("restart")

    def _mark_applied(self, seq: int, digest: int) -> None:
        self.last_applied = seq
        self._recent[seq] = digest
        if len(self._recent) > RECENT_DIGESTS:
            self._recent.popitem(last=False)
