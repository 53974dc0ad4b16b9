"""Stage 2 of the write path: ZMQ multipart frames -> (topic, seq, payload). Pure, no sockets.

Live (PUB->SUB): [topic, seq u64 BE, payload]. Replay replies as a DEALER sees them:
[b"", topic, seq, payload] (vLLM 0.33), the older [seq, payload], and the end marker seq 0xff..ff with
an empty payload. Anything else raises FrameError. The builders here are used by our publisher, so the
frames we send and the frames we accept come from one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

END_SEQ = 2**64 - 1
# vLLM writes it as (-1).to_bytes(8, "big", signed=True): the same 8 bytes.
END_SEQ_BYTES = b"\xff" * 8
SEQ_NUM_BYTES = 8


class FrameError(ValueError):
    """A multipart message that is not a vLLM KV-event message; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class LiveMessage(msgspec.Struct, frozen=True):
    topic: bytes
    seq: int
    payload: bytes


class ReplayMessage(msgspec.Struct, frozen=True):
    topic: bytes
    seq: int
    payload: bytes
    is_end: bool = False


def encode_seq(seq: int) -> bytes:
    """A seq as vLLM puts it on the wire: unsigned 64-bit big-endian."""
    return seq.to_bytes(SEQ_NUM_BYTES, "big")


def decode_seq(seq_frame: bytes) -> int:
    """The seq of a live or replayed message; raises FrameError unless the frame is exactly 8 bytes."""
    if len(seq_frame) != SEQ_NUM_BYTES:
        raise FrameError("bad_seq", f"seq frame has {len(seq_frame)} bytes, expected {SEQ_NUM_BYTES}")
    return int.from_bytes(seq_frame, "big")


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Parse a live PUB message `[topic, seq, payload]`; raises FrameError for any other shape."""
    if len(frames) != 3:
        raise FrameError("bad_frame_count", f"live message has {len(frames)} frames, expected 3")
    topic, seq_frame, payload = (bytes(frame) for frame in frames)
    return LiveMessage(topic=topic, seq=decode_seq(seq_frame), payload=payload)


def parse_replay(frames: Sequence[bytes]) -> ReplayMessage:
    """Parse one replay reply as a DEALER (or REQ) receives it.

    Accepted shapes:
      [b"", topic, seq, payload]  vLLM 0.33 via DEALER
      [topic, seq, payload]       vLLM 0.33 via REQ; also older vLLM via DEALER ([b"", seq, payload]),
                                  which reads the same with an empty topic
      [seq, payload]              older vLLM via REQ
    A seq of END_SEQ is the end marker (`is_end=True`); its payload must be empty.
    """
    frames = [bytes(frame) for frame in frames]
    if len(frames) == 4:
        if frames[0]:
            raise FrameError("bad_delimiter", "4-frame replay reply must start with an empty delimiter")
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    elif len(frames) == 3:
        topic, seq_frame, payload = frames
    elif len(frames) == 2:
        topic = b""
        seq_frame, payload = frames
    else:
        raise FrameError("bad_frame_count", f"replay reply has {len(frames)} frames, expected 2 to 4")
    seq = decode_seq(seq_frame)
    if seq == END_SEQ:
        if payload:
            raise FrameError("bad_end_marker", f"end marker carries a {len(payload)}-byte payload")
        return ReplayMessage(topic=topic, seq=seq, payload=payload, is_end=True)
    return ReplayMessage(topic=topic, seq=seq, payload=payload)


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames a PUB socket sends for one batch."""
    return [topic, encode_seq(seq), payload]


def replay_reply_frames(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """What a ROUTER sends for one buffered batch; the DEALER sees it without `identity`."""
    return [identity, b"", topic, encode_seq(seq), payload]


def replay_end_frames(identity: bytes) -> list[bytes]:
    """What a ROUTER sends after the last batch; the topic frame is empty even when a topic is set."""
    return [identity, b"", b"", END_SEQ_BYTES, b""]


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", encode_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """A request as a ROUTER receives it, `[identity, b"", start_seq]` -> (identity, start_seq).

    Like vLLM, the seq is read as an unsigned big-endian integer of any width and the delimiter's
    content is not checked; any other frame count raises FrameError (vLLM logs it and replies nothing).
    """
    if len(frames) != 3:
        raise FrameError("bad_replay_request", f"replay request has {len(frames)} frames, expected 3")
    return bytes(frames[0]), int.from_bytes(frames[2], "big")
