"""Stage 2 of the write path: ZMQ multipart frames -> (topic, seq, payload). Pure, no sockets.

Live (PUB->SUB): [topic, seq u64 BE, payload]. Replay replies as a DEALER sees them:
[b"", topic, seq, payload] (vLLM 0.33), the older [seq, payload], and the end marker seq 0xff..ff with
an empty payload. Anything else raises FrameError.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

END_SEQ = 2**64 - 1
END_SEQ_BYTES = b"\xff" * 8


class FrameError(ValueError):
    """A multipart message that is not a vLLM KV-event message; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class LiveMessage(msgspec.Struct, frozen=True):
    topic: bytes
    seq: int
    payload: bytes


class ReplayMessage(msgspec.Struct, frozen=True):
    topic: bytes
    seq: int
    payload: bytes
    is_end: bool = False


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    raise NotImplementedError  # filled by the wire-protocol work (issue 3)


def parse_replay(frames: Sequence[bytes]) -> ReplayMessage:
    raise NotImplementedError  # filled by the wire-protocol work (issue 3)
