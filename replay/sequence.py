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

ClearReason = Literal["restart", "history_lost"]
ReplayPurpose = Literal["join", "gap", "verify", "reconnect", "probe"]


class Apply(msgspec.Struct, Generic[T], frozen=True):
    """Apply this batch to the index now (actions come in seq order)."""

    seq: int
    item: T


class ClearPod(msgspec.Struct, frozen=True):
    """Drop every index entry of this stream before applying what follows."""

    reason: ClearReason


class FetchReplay(msgspec.Struct, frozen=True):
    """Ask the stream's replay socket for every batch with seq >= start_seq, then call `on_replay`.

    Always the last action of a list; live items arriving meanwhile are held by the tracker.
    """

    start_seq: int
    purpose: ReplayPurpose


Action = Apply[T] | ClearPod | FetchReplay


class ReplayedItem(msgspec.Struct, Generic[T], frozen=True):
    seq: int
    item: T
    digest: int


class SequenceTracker(Generic[T]):
    """Orders one stream's batches: apply next, skip duplicates, repair gaps, detect restarts.

    Contract (all seqs are vLLM's per-publisher counter, 0, 1, 2, ...):
    - First contact asks for a replay from seq 0 (late join); the replay and the live stream are merged.
    - seq == last_applied + 1: applied at once.
    - A seq already applied with the same digest: duplicate, skipped (normal right after a replay).
      The same seq with another digest: the engine restarted (clear, rejoin from 0).
    - A seq older than the remembered digests: verified against the replay socket from last_applied
      (same digest there -> a stale duplicate; missing or different -> restart).
    - A jump: replay from last_applied (its digest proves the engine is the same), merged with the held
      live batches. If the ring no longer holds last_applied (or the replay failed), the missing
      batches are lost: clear the pod, apply what exists, and set `resyncing`. A ring whose newest seq
      is below last_applied means a restart.
    - After a reconnect (`on_reconnect`) the next live batch is verified the same way whatever its seq:
      a restarted engine whose seqs happen to continue ours must not be stitched onto the old stream.
    - `resyncing` and `partial_view` end when the view is complete again: the shell calls
      `view_complete()` after an AllBlocksCleared, and a rejoin that starts at seq 0 clears them.
    """

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self.joined = False
        self.resyncing = False
        self.partial_view = False
        self.awaiting: FetchReplay | None = None
        self.verify_next = False
        self.num_duplicates = 0
        self.num_gaps = 0
        self.num_restarts = 0
        self.num_history_lost = 0
        self._recent: OrderedDict[int, int] = OrderedDict()
        self._held: dict[int, tuple[T, int]] = {}

    # -- inputs ---------------------------------------------------------------------------------

    def begin_join(self) -> list[Action[T]]:
        """First contact (connect mode at start): fetch everything the ring holds."""
        if self.joined or self.awaiting is not None:
            return []
        return [self._fetch(0, "join")]

    def begin_probe(self) -> list[Action[T]]:
        """The stream went quiet: check the ring for batches we never received (or a restart)."""
        if self.awaiting is not None:
            return []
        return [self._fetch(0 if self.last_applied is None else self.last_applied, "probe")]

    def on_reconnect(self) -> None:
        """The transport reconnected: the engine behind it may be a new process."""
        if self.last_applied is not None:
            self.verify_next = True

    def on_live(self, seq: int, item: T, digest: int) -> list[Action[T]]:
        if self.awaiting is not None:
            self._held[seq] = (item, digest)
            return []
        if not self.joined:
            self._held[seq] = (item, digest)
            return [self._fetch(0, "join")]
        last = self.last_applied
        if self.verify_next and last is not None:
            self.verify_next = False
            if seq != last or self._recent.get(seq) != digest:
                self._held[seq] = (item, digest)
                return [self._fetch(last, "reconnect")]
        if last is not None and seq <= last:
            known = self._recent.get(seq)
            if known == digest:
                self.num_duplicates += 1
                return []
            if known is not None:
                actions: list[Action[T]] = [self._restart()]
                return actions + self.on_live(seq, item, digest)
            self._held[seq] = (item, digest)
            return [self._fetch(last, "verify")]
        expected = 0 if last is None else last + 1
        if seq == expected:
            self._mark_applied(seq, digest)
            return [Apply(seq, item)]
        self.num_gaps += 1
        self._held[seq] = (item, digest)
        return [self._fetch(expected if last is None else last, "gap")]

    def on_replay(self, replayed: Sequence[ReplayedItem[T]], complete: bool) -> list[Action[T]]:
        """The reply to the last FetchReplay: `replayed` in seq order, `complete` = end marker seen.

        A failed or timed-out request is `([], False)`.
        """
        request = self.awaiting
        if request is None:
            return []
        self.awaiting = None
        self.joined = True
        self.verify_next = False
        items = [r for r in replayed if r.seq >= request.start_seq]
        last = self.last_applied
        actions: list[Action[T]] = []
        unverified = False
        if last is not None:
            if items and items[0].seq == last:
                if items[0].digest != self._recent.get(last, items[0].digest):
                    return [self._restart(), self._fetch(0, "join")]
                items = items[1:]
            elif items:
                # The ring no longer holds last_applied, so nothing proves these batches come from the
                # engine we were following: treat the gap as lost history.
                unverified = True
            elif complete or request.purpose == "verify":
                # The ring's newest seq is below what we applied (or a seq went back and cannot be
                # checked): a new engine.
                return [self._restart(), self._fetch(0, "join")]
        merged: dict[int, tuple[T, int]] = dict(self._held)
        for r in items:
            merged[r.seq] = (r.item, r.digest)
        pending = sorted(seq for seq in merged if last is None or seq > last)
        # Held live copies of replayed batches, and anything at or below last_applied.
        self.num_duplicates += len(self._held) + len(items) - len(pending)
        self._held = {}
        if not pending:
            return actions
        if request.purpose == "probe":
            self.num_gaps += 1
        expected = 0 if last is None else last + 1
        gapless = pending[-1] - pending[0] == len(pending) - 1
        if unverified or not gapless or pending[0] != expected:
            if last is None and gapless:
                # Joined late: the ring no longer starts at 0. Nothing applied yet, nothing to clear.
                self.partial_view = True
            else:
                self.num_history_lost += 1
                self.resyncing = True
                actions.append(ClearPod("history_lost"))
        elif last is None:
            self.partial_view = False
            self.resyncing = False
        for seq in pending:
            item, digest = merged[seq]
            self._mark_applied(seq, digest)
            actions.append(Apply(seq, item))
        return actions

    def view_complete(self) -> None:
        """The pod's view is whole again (it cleared its cache): leave `resyncing` / `partial_view`."""
        self.resyncing = False
        self.partial_view = False

    # -- internals ------------------------------------------------------------------------------

    def _fetch(self, start_seq: int, purpose: ReplayPurpose) -> FetchReplay:
        self.awaiting = FetchReplay(start_seq, purpose)
        return self.awaiting

    def _restart(self) -> ClearPod:
        self.num_restarts += 1
        self.verify_next = False
        self.last_applied = None
        self.resyncing = False
        self.partial_view = False
        self._recent.clear()
        return ClearPod("restart")

    def _mark_applied(self, seq: int, digest: int) -> None:
        self.last_applied = seq
        self._recent[seq] = digest
        if len(self._recent) > RECENT_DIGESTS:
            self._recent.popitem(last=False)
