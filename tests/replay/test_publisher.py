"""Our publisher against vLLM 0.33's ZmqEventPublisher: same live frames, same replay replies, byte for byte.

The expected bytes are the frames captured from vLLM on 127.0.0.1 (tests/vectors); the batches are rebuilt
from the recorded fields, published through a real PUB/ROUTER and read back on real SUB/DEALER/REQ sockets.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from kvindex.replay.endpoints import offset_endpoint_port, should_bind
from kvindex.replay.publisher import EventPublisher, encode_batch
from kvindex.replay.wire import KVEventBatch
from replay_support import hexes, nothing_arrives, recv_frames, wire_event_from_record

Ctx = zmq.Context[zmq.Socket[bytes]]
CAPTURE_ATTEMPTS = 30


def recorded_batches(messages: list[dict[str, Any]]) -> list[tuple[float, list[Any], int | None]]:
    """(ts, wire events, rank) of each recorded live message, from its recorded builtins."""
    batches = []
    for message in messages:
        ts, events, rank = message["payload"]["generic_msgpack"]
        batches.append((ts, [wire_event_from_record(event) for event in events], rank))
    return batches


def batches_from_payloads(frames_hex: list[list[str]]) -> list[tuple[float, list[Any], int | None]]:
    """The same from raw payload bytes, read with a schema-less msgpack decode."""
    batches = []
    for frames in frames_hex:
        ts, events, rank = msgspec.msgpack.decode(bytes.fromhex(frames[-1]))
        batches.append((ts, [wire_event_from_record(event) for event in events], rank))
    return batches


def capture_live(
    ctx: Ctx,
    make_publisher: Callable[[int], EventPublisher],
    publish: Callable[[EventPublisher], None],
    count: int,
) -> list[list[bytes]]:
    """Bind a SUB (vLLM connects to `tcp://127.0.0.1:P`), publish, and return the first `count` messages.

    A PUB drops what it sends before the SUB's subscription reaches it, and nothing says when that has
    happened, so an attempt that misses seq 0 is thrown away and repeated with a fresh pair of sockets.
    """
    for _ in range(CAPTURE_ATTEMPTS):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(b"")
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        publisher = make_publisher(port)
        try:
            sub.poll(50)  # a bound SUB attaches the incoming pipe only when polled (spec 1.1)
            publish(publisher)
            assert publisher.flush(5.0)
            received: list[list[bytes]] = []
            while len(received) < count and sub.poll(500, zmq.POLLIN):
                received.append(sub.recv_multipart(zmq.NOBLOCK))
            if len(received) == count and received[0][1] == bytes(8):
                return received
        finally:
            publisher.close()
            sub.close(linger=0)
    raise AssertionError(f"no complete capture in {CAPTURE_ATTEMPTS} attempts")


def publish_all(batches: list[tuple[float, list[Any], int | None]]) -> Callable[[EventPublisher], None]:
    def publish(publisher: EventPublisher) -> None:
        for ts, events, _rank in batches:
            # The recorded rank was filled in by vLLM's publish(); ours must do the same.
            assert publisher.publish(events, ts=ts)

    return publish


# --- pure helpers ---------------------------------------------------------------------------------


def test_bind_or_connect_matches_vllm(wire_frames: dict[str, Any]) -> None:
    for endpoint, decision in wire_frames["bind_or_connect_examples"].items():
        assert should_bind(endpoint) == (decision == "bind"), endpoint


def test_dp_port_offsets_match_vllm(wire_frames: dict[str, Any]) -> None:
    for example, expected in wire_frames["offset_endpoint_port_examples"].items():
        endpoint, rank_text = example.split(" @dp")
        if expected.startswith("raises ValueError"):
            with pytest.raises(ValueError, match="must contain 'inproc' or 'tcp'"):
                offset_endpoint_port(endpoint, int(rank_text))
        else:
            assert offset_endpoint_port(endpoint, int(rank_text)) == expected, example
    assert offset_endpoint_port(None, 3) is None


def test_encode_batch_is_byte_identical_to_vllm_payloads(wire_frames: dict[str, Any]) -> None:
    for message, (ts, events, rank) in zip(
        wire_frames["live_messages"], recorded_batches(wire_frames["live_messages"]), strict=True
    ):
        assert (
            encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)).hex()
            == message["frames_hex"][2]
        )


def test_replay_hwm_follows_buffer_steps(ctx: Ctx, wire_frames: dict[str, Any]) -> None:
    for buffer_steps, expected in ((10_000, wire_frames["main_publisher"]["replay_socket_sndhwm"]), (3, 8)):
        with EventPublisher(
            "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=buffer_steps, ctx=ctx
        ) as publisher:
            assert publisher.replay_hwm == expected
            assert publisher._replay is not None
            assert publisher._replay.getsockopt(zmq.SNDHWM) == expected


# --- live frames ----------------------------------------------------------------------------------


def test_live_frames_are_byte_identical_to_vllm(ctx: Ctx, wire_frames: dict[str, Any]) -> None:
    messages = wire_frames["live_messages"]
    captured = capture_live(
        ctx,
        lambda port: EventPublisher(f"tcp://127.0.0.1:{port}", topic="kv-events", ctx=ctx),
        publish_all(recorded_batches(messages)),
        len(messages),
    )
    assert [hexes(frames) for frames in captured] == [message["frames_hex"] for message in messages]


def test_dp_rank_1_offsets_the_port_and_fills_only_a_missing_rank(
    ctx: Ctx, wire_frames: dict[str, Any]
) -> None:
    case = wire_frames["dp_rank_1_default_topic"]
    expected = [message["frames_hex"] for message in case["messages"]]
    batches = batches_from_payloads(expected)

    def publish(publisher: EventPublisher) -> None:
        (ts0, events0, _), (ts1, events1, rank1) = batches
        publisher.publish(events0, ts=ts0)  # rank None -> the publisher's rank, 1
        publisher.publish(events1, ts=ts1, data_parallel_rank=rank1)  # explicit 5 is kept

    # Configured one port below the bound SUB: the DP offset must land on it.
    captured = capture_live(
        ctx, lambda port: EventPublisher(f"tcp://127.0.0.1:{port - 1}", dp_rank=1, ctx=ctx), publish, 2
    )
    assert [hexes(frames) for frames in captured] == expected


# --- replay ---------------------------------------------------------------------------------------


@pytest.fixture
def main_publisher(ctx: Ctx, wire_frames: dict[str, Any]) -> Iterator[EventPublisher]:
    """vLLM's capture run: topic kv-events, the five recorded batches published (seq 0..4)."""
    publisher = EventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-events", ctx=ctx
    )
    publish_all(recorded_batches(wire_frames["live_messages"]))(publisher)
    assert publisher.flush(5.0)
    assert (publisher.sent_count, publisher.last_seq, publisher.dropped_count) == (5, 4, 0)
    yield publisher
    publisher.close()


def connect(ctx: Ctx, kind: int, endpoint: str | None) -> zmq.Socket[bytes]:
    """A socket connected to `endpoint` with LINGER 0: use it in a `with` block so it is closed."""
    assert endpoint is not None
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def dealer_replies(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    replies = [recv_frames(sock)]
    while replies[-1][2] != b"\xff" * 8:
        replies.append(recv_frames(sock))
    return replies


def test_dealer_replay_is_byte_identical_to_vllm(
    ctx: Ctx, main_publisher: EventPublisher, wire_frames: dict[str, Any]
) -> None:
    case = wire_frames["replay_dealer_from_seq2"]
    with connect(ctx, zmq.DEALER, main_publisher.replay_endpoint) as dealer:
        dealer.send_multipart([bytes.fromhex(frame) for frame in case["request_frames_sent_by_dealer_hex"]])
        assert [hexes(reply) for reply in dealer_replies(dealer)] == [
            r["frames_hex"] for r in case["reply_messages"]
        ]


def test_req_sees_only_the_first_reply_like_vllm(
    ctx: Ctx, main_publisher: EventPublisher, wire_frames: dict[str, Any]
) -> None:
    case = wire_frames["replay_req_from_seq1"]
    for request_hex, expected in (
        (case["request_frame_sent_by_req_hex"], case["replies_received_by_REQ"][0]),
        (
            [(case["second_request_start_seq"]).to_bytes(8, "big").hex()],
            case["second_request_reply_frames_hex"][0],
        ),
    ):
        with connect(ctx, zmq.REQ, main_publisher.replay_endpoint) as req:
            req.send_multipart([bytes.fromhex(frame) for frame in request_hex])
            assert hexes(recv_frames(req)) == expected


def test_replay_beyond_newest_and_four_byte_seq(
    ctx: Ctx, main_publisher: EventPublisher, wire_frames: dict[str, Any]
) -> None:
    with connect(ctx, zmq.DEALER, main_publisher.replay_endpoint) as dealer:
        dealer.send_multipart([b"", (10_000).to_bytes(8, "big")])
        assert [hexes(reply) for reply in dealer_replies(dealer)] == wire_frames[
            "replay_dealer_from_seq10000"
        ]
        dealer.send_multipart([b"", bytes.fromhex("00000004")])
        assert [hexes(reply) for reply in dealer_replies(dealer)] == wire_frames[
            "replay_dealer_4byte_start_seq4"
        ]


def test_malformed_request_gets_no_reply_and_the_next_one_works(
    ctx: Ctx, main_publisher: EventPublisher
) -> None:
    with connect(ctx, zmq.DEALER, main_publisher.replay_endpoint) as dealer:
        dealer.send_multipart([(0).to_bytes(8, "big")])  # no delimiter: vLLM ignores it
        dealer.send_multipart([b"", b"", b"", b""])  # too many frames
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = dealer_replies(dealer)
        assert [int.from_bytes(reply[2], "big") for reply in replies] == [3, 4, 2**64 - 1]
        assert main_publisher.bad_replay_requests_count == 2
        assert nothing_arrives(dealer, 200)


def test_ring_overflow_replays_from_the_oldest_batch_like_vllm(ctx: Ctx, wire_frames: dict[str, Any]) -> None:
    case = wire_frames["ring_overflow_buffer_steps_3"]
    batches = batches_from_payloads(case["live_frames_hex"])
    with EventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3, ctx=ctx
    ) as publisher:
        publish_all(batches)(publisher)
        assert publisher.flush(5.0) and publisher.last_seq == case["published_seqs"][-1]
        with connect(ctx, zmq.DEALER, publisher.replay_endpoint) as dealer:
            dealer.send_multipart([b"", case["replay_request_from_seq"].to_bytes(8, "big")])
            assert [hexes(reply) for reply in dealer_replies(dealer)] == case["replay_reply_frames_hex"]
    overflow_live = capture_live(
        ctx,
        lambda port: EventPublisher(f"tcp://127.0.0.1:{port}", buffer_steps=3, ctx=ctx),
        publish_all(batches),
        6,
    )
    assert [hexes(frames) for frames in overflow_live] == case["live_frames_hex"]


# --- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])
def test_ephemeral_endpoints_resolve_to_the_bound_port(ctx: Ctx, endpoint: str) -> None:
    with EventPublisher(endpoint, replay_endpoint=endpoint, ctx=ctx) as publisher:
        for resolved in (publisher.endpoint, publisher.replay_endpoint):
            assert resolved is not None
            port = int(resolved.rsplit(":", 1)[1])
            assert port > 0
        assert publisher.publish([], ts=1.0) and publisher.flush(5.0)
        with connect(ctx, zmq.DEALER, publisher.replay_endpoint) as dealer:
            dealer.send_multipart([b"", bytes(8)])
            assert [int.from_bytes(reply[2], "big") for reply in dealer_replies(dealer)] == [0, 2**64 - 1]


def test_close_is_idempotent_and_publish_after_close_raises(ctx: Ctx) -> None:
    publisher = EventPublisher("tcp://127.0.0.1:*", ctx=ctx)
    publisher.close()
    publisher.close()
    with pytest.raises(RuntimeError):
        publisher.publish([])


def test_publish_returns_promptly_even_without_subscribers(ctx: Ctx) -> None:
    # vLLM connects when the endpoint names a host; with nobody listening PUB must still not block us.
    with EventPublisher("tcp://127.0.0.1:1", ctx=ctx, max_queue_size=4, publish_timeout_s=0.5) as publisher:
        for ts in range(50):
            publisher.publish([], ts=float(ts))
        assert publisher.flush(5.0)
        assert publisher.sent_count + publisher.dropped_count == 50


def test_bind_true_binds_a_fixed_loopback_port_that_vllms_rule_would_dial(ctx: Ctx) -> None:
    """An engine restarted on the port it had: vLLM's rule connects `tcp://127.0.0.1:P`, bind=True binds."""
    with socket.socket() as probe:  # a port the kernel just handed out (released at once on close)
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    with connect(ctx, zmq.SUB, endpoint) as sub, EventPublisher(endpoint, ctx=ctx, bind=True) as publisher:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert publisher.endpoint == endpoint

        def arrived() -> bool:
            assert publisher.publish([], ts=1.0)
            return bool(sub.poll(50))

        assert any(arrived() for _ in range(100)), "a SUB dialling the fixed port never heard the publisher"
