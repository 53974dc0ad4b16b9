"""Replay client: ask a pod's ROUTER socket for every buffered batch from a seq (DEALER, with timeout).

vLLM gives no error when the ring no longer holds the seq asked for: it silently starts at its oldest
batch, so `history_lost` compares the first replayed seq with the one requested.
"""

from __future__ import annotations

import time

import msgspec
import zmq
from kvindex.replay.frames import FrameError, ReplayMessage, parse_replay, replay_request_frames


class ReplayResult(msgspec.Struct):
    messages: list[ReplayMessage]  # in seq order, end marker excluded
    complete: bool  # the end marker arrived before the timeout
    history_lost: bool  # the first replayed seq is later than the one requested (ring overflowed)
    # FrameError reason -> replies that were not vLLM replay messages (skipped; the caller counts them)
    bad_frames: dict[str, int] = {}
    error: str | None = None  # the request could not be sent (e.g. a malformed endpoint)


def replay_from(
    endpoint: str,
    start_seq: int,
    *,
    timeout_s: float = 2.0,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> ReplayResult:
    """Request every buffered batch with seq >= start_seq and collect them until the end marker.

    A fresh DEALER (linger 0) serves each call, so replies to a timed-out request can never be read as
    the answer to a later one. `timeout_s` bounds the whole call; on timeout `complete` is False and
    `messages` holds what arrived.
    """
    context = ctx if ctx is not None else zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    messages: list[ReplayMessage] = []
    bad_frames: dict[str, int] = {}
    complete = False
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request_frames(start_seq))
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms, zmq.POLLIN):
                break
            frames = dealer.recv_multipart(zmq.NOBLOCK)
            try:
                message = parse_replay(frames)
            except FrameError as exc:
                bad_frames[exc.reason] = bad_frames.get(exc.reason, 0) + 1
                continue
            if message.is_end:
                complete = True
                break
            messages.append(message)
    finally:
        dealer.close(linger=0)
    history_lost = bool(messages) and messages[0].seq > start_seq
    return ReplayResult(
        messages=messages,
        complete=complete,
        history_lost=history_lost,
        bad_frames=bad_frames,
    )
