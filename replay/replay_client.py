"""Replay client: ask a pod's ROUTER socket for every buffered batch from a seq (DEALER, with timeout).

vLLM gives no error when the ring no longer holds the seq asked for: it silently starts at its oldest
batch, so `history_lost` compares the first replayed seq with the one requested.
"""

from __future__ import annotations

import msgspec
import zmq

from kvindex.replay.frames import ReplayMessage


class ReplayResult(msgspec.Struct):
    requested_seq: int
    messages: list[ReplayMessage]  # in seq order, end marker excluded
    complete: bool  # the end marker arrived before the timeout
    history_lost: bool  # the first replayed seq is later than requested_seq (ring overflowed)


def replay_from(
    endpoint: str, start_seq: int, *, timeout_s: float = 2.0, ctx: zmq.Context | None = None
) -> ReplayResult:
    raise NotImplementedError  # filled by the wire-protocol work (issue 3)
