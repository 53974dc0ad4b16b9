"""The sidecar's write path: the ingest pipeline's BatchObserver. Every batch the engine stream's tracker
applies is forwarded downstream byte for byte (the engine's own payload: token ids, parent hashes, extra
keys, medium) under the sidecar's own seq, and applied to the pod's block set; every clear of a stream
(an engine restart, lost history, a resync from the ring) becomes one AllBlocksCleared batch first.

One lock covers "publish + apply", so a snapshot (block set + the downstream seq it reflects) is always
a state some prefix of the downstream stream leads to, exactly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
from kvindex.hashing import BlockHasher
from kvindex.indexer.decode import DecodeError, decode_batch
from kvindex.indexer.events import PREFIX_SPEC_KINDS, BlocksRemoved, BlocksStored, KVEvent, PodRef
from kvindex.indexer.hash_check import diagnose_mismatch
from kvindex.indexer.ingest.observer import ObservedClear
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.snapshot import SNAPSHOT_SCHEMA, PodSnapshot, RankSnapshot
from kvindex.replay.publisher import EventPublisher, encode_batch
from kvindex.replay.wire import AllBlocksCleared, KVEventBatch
from kvindex.sidecar.hash_check import RankHashCheck
from kvindex.sidecar.state import PodBlocks

log = logging.getLogger("kvindex.sidecar")


class RankCounts(msgspec.Struct):
    """What the relay did on one DP rank (plain counters, read at scrape time)."""

    batches_forwarded: int = 0
    clears_emitted: int = 0
    restarts: int = 0
    history_lost: int = 0
    publish_dropped: int = 0


class Relay:
    """Engine batches -> downstream publishers (one per DP rank) + the pod's block set.

    `publishers`: rank -> the downstream publisher for that rank (its seq is the rank's downstream seq).
    `partial_of(rank)`: whether the engine stream of that rank is flagged (joined after its ring lost
    history, or resyncing); read when a snapshot is taken. Every forwarded batch is hash-checked in full
    (sidecar/hash_check.py) against `model`'s settings.
    """

    def __init__(
        self,
        pod_id: str,
        model: ModelConfig,
        publishers: Mapping[int, EventPublisher],
        *,
        sidecar_id: str,
        partial_of: Callable[[int], bool],
    ) -> None:
        self.pod_id = pod_id
        self.model = model.name
        self.block_size = model.block_size
        self.sidecar_id = sidecar_id
        self._config = model
        self._publishers = dict(publishers)
        self._partial_of = partial_of
        hasher = BlockHasher(algo=model.hash_algo, block_size=model.block_size, seed=model.hash_seed)
        self.hash_checks = {rank: RankHashCheck(hasher) for rank in self._publishers}
        self._mismatch_logged = False
        self._lock = threading.Lock()
        self._blocks = PodBlocks()
        # rank -> the downstream seq of the newest batch handed to its publisher (None: none yet).
        self._seqs: dict[int, int | None] = {rank: None for rank in self._publishers}
        self.counts: dict[int, RankCounts] = {rank: RankCounts() for rank in self._publishers}
        # rank -> the engine stream was flagged (partial) at the last batch or clear forwarded.
        self._flagged: dict[int, bool] = {rank: False for rank in self._publishers}

    # -- BatchObserver (on the pod's ingest worker thread) ---------------------------------------

    def on_batch(self, ref: PodRef, seq: int, payload: bytes, events: Sequence[KVEvent]) -> None:
        rank = ref.dp_rank
        publisher = self._publishers.get(rank)
        if publisher is None:
            return  # a rank this sidecar was not given an engine for
        self._check_hashes(ref, seq, payload, events)
        if self._partial_of(rank) and not self._flagged[rank]:
            # The engine stream became partial without a clear (joined after the engine's ring lost
            # its start): a clear first tells consumers to check the snapshot, which says partial.
            self.on_clear(ref, "history_lost")
        with self._lock:
            self._publish(rank, publisher, payload)
            self._blocks.rank(rank).apply(events)
            self.counts[rank].batches_forwarded += 1
            self._flagged[rank] = self._partial_of(rank)

    def on_clear(self, ref: PodRef, reason: ObservedClear) -> None:
        rank = ref.dp_rank
        publisher = self._publishers.get(rank)
        if publisher is None:
            return
        counts = self.counts[rank]
        if reason == "restart":
            counts.restarts += 1
        elif reason == "history_lost":
            counts.history_lost += 1
        payload = encode_batch(
            KVEventBatch(ts=time.time(), events=[AllBlocksCleared()], data_parallel_rank=rank)
        )
        with self._lock:
            self._publish(rank, publisher, payload)
            self._blocks.rank(rank).clear()
            self.hash_checks[rank].clear()
            counts.clears_emitted += 1
            self._flagged[rank] = self._partial_of(rank)
        log.info(
            "pod %s rank %d: engine stream cleared (%s): AllBlocksCleared downstream",
            ref.pod_id,
            rank,
            reason,
        )

    def _check_hashes(self, ref: PodRef, seq: int, payload: bytes, kept: Sequence[KVEvent]) -> None:
        """Recompute every prefix-group BlockStored of the batch from its token ids (the ingest decode
        skipped them, so the payload is decoded again in full when it stores anything)."""
        check = self.hash_checks[ref.dp_rank]
        if not any(type(e) is BlocksStored for e in kept):
            check.apply(kept)  # removals and clears only: nothing to recompute
            return
        try:
            full = decode_batch(payload).batch.events
        except DecodeError:
            return
        groups = self._config.prefix_group_idxs
        events = [e for e in full if _in_prefix_groups(e, groups)]
        mismatches = check.apply(events)
        if mismatches and not self._mismatch_logged:
            self._mismatch_logged = True
            event = mismatches[0]
            why = diagnose_mismatch(event, self._config) if event.parent_key is None else "a continued chain"
            log.warning(
                "pod %s rank %d seq %d: block hashes differ from model %s's settings: %s",
                ref.pod_id,
                ref.dp_rank,
                seq,
                self.model,
                why,
            )

    def _publish(self, rank: int, publisher: EventPublisher, payload: bytes) -> None:
        """Under the lock. The publisher numbers what it is handed in order: the newest seq is ours."""
        if publisher.publish_payload(payload):
            last = self._seqs[rank]
            self._seqs[rank] = 0 if last is None else last + 1
        else:
            # The block set has the batch but the stream lost it: its consumers see a gap they cannot
            # repair from the ring; only a snapshot brings them back.
            self.counts[rank].publish_dropped += 1
            log.error("pod %s rank %d: downstream queue full, a batch was dropped", self.pod_id, rank)

    # -- reads (any thread) ----------------------------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        """Every rank's block set and the downstream seq it reflects, taken under the relay's lock."""
        ranks = []
        with self._lock:
            for rank in sorted(self._publishers):
                check = self.hash_checks[rank]
                ranks.append(
                    RankSnapshot(
                        dp_rank=rank,
                        seq=self._seqs[rank],
                        partial=self._partial_of(rank),
                        tiers=self._blocks.rank(rank).tier_blocks(),
                        hash_checks_total=check.checked,
                        hash_mismatches_total=check.mismatched,
                    )
                )
        return PodSnapshot(SNAPSHOT_SCHEMA, self.sidecar_id, self.pod_id, self.model, self.block_size, ranks)

    def downstream_seq(self, rank: int) -> int | None:
        return self._seqs.get(rank)

    def num_blocks(self, rank: int | None = None) -> int:
        with self._lock:
            if rank is None:
                return self._blocks.num_blocks()
            return self._blocks.rank(rank).num_blocks()


def _in_prefix_groups(event: KVEvent, groups: frozenset[int]) -> bool:
    """The events ingest keeps for the index: those of the scored prefix's KV-cache groups."""
    if type(event) is BlocksStored:
        spec = event.spec_kind
        return (spec is None or spec in PREFIX_SPEC_KINDS) and (
            event.group_idx is None or event.group_idx in groups
        )
    if type(event) is BlocksRemoved:
        return event.group_idx is None or event.group_idx in groups
    return True
