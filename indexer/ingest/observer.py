"""The ingest pipeline's one outward seam besides the index: a `BatchObserver` is told, on the pod's
worker thread and in stream order, of every batch the sequence tracker applies (with the engine's payload
bytes) and of every clear of a stream's entries. The sidecar relays the engine's stream through it;
kvindex serve passes none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from kvindex.indexer.events import KVEvent, PodRef
from kvindex.replay.sequence import ClearReason

# Why a stream's entries were dropped: the tracker's reasons, a long disconnection ("forget"), a bind-mode
# pod now publishing another model ("model"), or a snapshot replacing them ("snapshot").
ObservedClear = ClearReason | Literal["forget", "model", "snapshot"]


class BatchObserver(Protocol):
    def on_batch(self, ref: PodRef, seq: int, payload: bytes, events: Sequence[KVEvent]) -> None:
        """Batch `seq` of the stream `ref` was applied: `payload` as the engine encoded it, `events`
        the ones kept for the index (non-prefix groups and block-size mismatches filtered out). A batch
        that could not be decoded is not reported. Called before the index sees the events; must not
        block for long (the pod's worker waits)."""
        ...

    def on_clear(self, ref: PodRef, reason: ObservedClear) -> None:
        """Every entry of the stream `ref` was dropped; the batches reported next rebuild it."""
        ...
