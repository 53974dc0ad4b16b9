"""Frame parsing against vLLM 0.33's captured ZMQ frames, older reply shapes, and random garbage."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvindex.replay.frames import (
    END_SEQ,
    FrameError,
    decode_seq,
    live_frames,
    parse_live,
    parse_replay,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
)


def unhex(frames_hex: list[str]) -> list[bytes]:
    return [bytes.fromhex(frame) for frame in frames_hex]


def test_every_captured_live_message_parses_to_its_recorded_topic_and_seq(
    wire_frames: dict[str, Any],
) -> None:
    for message in wire_frames["live_messages"]:
        frames = unhex(message["frames_hex"])
        live = parse_live(frames)
        assert live.topic == message["topic"].encode()
        assert live.seq == message["seq"]
        assert live.payload == frames[2]
        assert live_frames(live.topic, live.seq, live.payload) == frames


def test_captured_dealer_replay_parses_and_ends_with_the_marker(wire_frames: dict[str, Any]) -> None:
    replies = wire_frames["replay_dealer_from_seq2"]["reply_messages"]
    parsed = [parse_replay(unhex(reply["frames_hex"])) for reply in replies]
    assert [m.seq for m in parsed[:-1]] == [r["seq_signed"] for r in replies[:-1]]
    assert all(m.topic == b"kv-events" and not m.is_end for m in parsed[:-1])
    assert parsed[-1].is_end and parsed[-1].seq == END_SEQ and parsed[-1].payload == b""
    assert parsed[-1].topic == b""  # the marker's topic is empty even with a topic configured
    live_by_seq = {m["seq"]: bytes.fromhex(m["frames_hex"][2]) for m in wire_frames["live_messages"]}
    assert all(m.payload == live_by_seq[m.seq] for m in parsed[:-1])


def test_captured_req_reply_is_the_three_frame_form(wire_frames: dict[str, Any]) -> None:
    case = wire_frames["replay_req_from_seq1"]
    (reply,) = case["replies_received_by_REQ"]
    message = parse_replay(unhex(reply))
    assert (message.topic, message.seq, message.is_end) == (b"kv-events", 1, False)
    second = parse_replay(unhex(case["second_request_reply_frames_hex"][0]))
    assert second.seq == case["second_request_start_seq"]


def test_captured_ring_overflow_past_newest_and_four_byte_replies(wire_frames: dict[str, Any]) -> None:
    overflow = wire_frames["ring_overflow_buffer_steps_3"]
    seqs = [parse_replay(unhex(frames)).seq for frames in overflow["replay_reply_frames_hex"]]
    assert seqs == [3, 4, 5, END_SEQ] == [s % 2**64 for s in overflow["replay_reply_seqs"]]
    (only,) = wire_frames["replay_dealer_from_seq10000"]
    assert parse_replay(unhex(only)).is_end
    four = [parse_replay(unhex(frames)) for frames in wire_frames["replay_dealer_4byte_start_seq4"]]
    assert [(m.seq, m.is_end) for m in four] == [(4, False), (END_SEQ, True)]


def test_captured_dp_rank_1_live_messages_have_an_empty_topic(wire_frames: dict[str, Any]) -> None:
    for message in wire_frames["dp_rank_1_default_topic"]["messages"]:
        assert parse_live(unhex(message["frames_hex"])).topic == b""


def test_older_two_frame_reply_and_older_dealer_reply() -> None:
    # Before 0.33 the ROUTER sent [identity, b"", seq, payload]: REQ sees [seq, payload], DEALER [b"", seq, payload].
    seq7 = (7).to_bytes(8, "big")
    assert parse_replay([seq7, b"payload"]) == parse_replay([b"", seq7, b"payload"])
    message = parse_replay([seq7, b"payload"])
    assert (message.topic, message.seq, message.payload, message.is_end) == (b"", 7, b"payload", False)
    assert parse_replay([b"\xff" * 8, b""]).is_end


def test_builders_match_the_captured_frames(wire_frames: dict[str, Any]) -> None:
    reply = unhex(wire_frames["replay_dealer_from_seq2"]["reply_messages"][0]["frames_hex"])
    assert replay_reply_frames(b"id", reply[1], 2, reply[3]) == [b"id", *reply]
    end = unhex(wire_frames["replay_dealer_from_seq2"]["reply_messages"][-1]["frames_hex"])
    assert replay_end_frames(b"id") == [b"id", *end]
    assert replay_request_frames(2) == unhex(
        wire_frames["replay_dealer_from_seq2"]["request_frames_sent_by_dealer_hex"]
    )


def test_replay_request_accepts_any_seq_width_and_rejects_other_shapes() -> None:
    assert parse_replay_request([b"id", b"", bytes.fromhex("00000004")]) == (b"id", 4)
    with pytest.raises(FrameError) as info:
        parse_replay_request([b"id", (0).to_bytes(8, "big")])
    assert info.value.reason == "bad_replay_request"


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", b"\x00" * 8], "bad_frame_count"),
        ([b"t", b"\x00" * 7, b"p"], "bad_seq"),
        ([b"t", b"\x00" * 8, b"p", b"x"], "bad_frame_count"),
    ],
)
def test_bad_live_messages_raise_frame_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_live(frames)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"x", b"t", b"\x00" * 8, b"p"], "bad_delimiter"),
        ([b"", b"", b"\xff" * 8, b"not empty"], "bad_end_marker"),
        ([b"\x00" * 8], "bad_frame_count"),
        ([b"", b"t", b"\x00" * 8, b"p", b""], "bad_frame_count"),
        ([b"", b"t", b"\x00\x01", b"p"], "bad_seq"),
    ],
)
def test_bad_replay_replies_raise_frame_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_replay(frames)
    assert info.value.reason == reason


def test_decode_seq_is_unsigned_big_endian() -> None:
    assert decode_seq(bytes.fromhex("8000000000000001")) == 2**63 + 1


frame_lists = st.lists(st.binary(max_size=12), max_size=6)


@given(frame_lists)
def test_random_frames_raise_nothing_but_frame_error(frames: list[bytes]) -> None:
    for parse in (parse_live, parse_replay):
        try:
            message = parse(frames)
        except FrameError:
            continue
        assert message.payload == frames[-1]
        assert 0 <= message.seq <= END_SEQ


@given(st.binary(max_size=8), st.integers(0, 2**64 - 2), st.binary(max_size=16), st.integers(0, 4))
def test_truncated_frames_never_parse_as_something_else(
    topic: bytes, seq: int, payload: bytes, cut: int
) -> None:
    frames = [b"", topic, seq.to_bytes(8, "big"), payload][: 4 - cut] if cut < 4 else []
    try:
        message = parse_replay(frames)
    except FrameError:
        return
    # Dropping trailing frames can only leave a shape whose fields come from the original frames.
    assert message.seq in (seq, int.from_bytes(topic, "big")) and message.payload in frames
