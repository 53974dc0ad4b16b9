"""replay_from against our publisher (real ROUTER) and against a raw ROUTER playing an older or broken vLLM."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from kvindex.replay.frames import END_SEQ_BYTES
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.replay_client import replay_from
from kvindex.replay.wire import AllBlocksCleared, BlockRemoved
from replay_support import recv_frames

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def publisher(ctx: Ctx) -> Iterator[EventPublisher]:
    """Seqs 0..9 published, ring of 4: seqs 6..9 are buffered."""
    with EventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv", buffer_steps=4, ctx=ctx
    ) as pub:
        for seq in range(10):
            pub.publish([BlockRemoved(block_hashes=[seq], medium="GPU")], ts=float(seq))
        assert pub.flush(5.0)
        yield pub


def endpoint_of(publisher: EventPublisher) -> str:
    assert publisher.replay_endpoint is not None
    return publisher.replay_endpoint


def test_replay_from_the_middle_of_the_ring(ctx: Ctx, publisher: EventPublisher) -> None:
    result = replay_from(endpoint_of(publisher), 8, timeout_s=5.0, ctx=ctx)
    assert result.complete and not result.history_lost
    assert [m.seq for m in result.messages] == [8, 9]
    assert all(m.topic == b"kv" and not m.is_end for m in result.messages)


def test_replay_from_before_the_oldest_reports_lost_history(ctx: Ctx, publisher: EventPublisher) -> None:
    result = replay_from(endpoint_of(publisher), 2, timeout_s=5.0, ctx=ctx)
    assert result.complete and result.history_lost
    assert [m.seq for m in result.messages] == [6, 7, 8, 9]


def test_replay_beyond_the_newest_is_complete_and_empty(ctx: Ctx, publisher: EventPublisher) -> None:
    result = replay_from(endpoint_of(publisher), 10, timeout_s=5.0, ctx=ctx)
    assert result.complete and not result.history_lost and result.messages == []


def test_replay_after_a_malformed_request_still_works(ctx: Ctx, publisher: EventPublisher) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint_of(publisher))
    dealer.send_multipart([b"garbage"])
    dealer.close(linger=0)
    result = replay_from(endpoint_of(publisher), 9, timeout_s=5.0, ctx=ctx)
    assert [m.seq for m in result.messages] == [9] and result.complete


def test_req_client_gets_the_first_batch(ctx: Ctx, publisher: EventPublisher) -> None:
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint_of(publisher))
    req.send((7).to_bytes(8, "big"))
    topic, seq, _payload = recv_frames(req)
    assert (topic, int.from_bytes(seq, "big")) == (b"kv", 7)
    req.close(linger=0)


def test_timeout_without_a_server_returns_incomplete(ctx: Ctx) -> None:
    router = ctx.socket(zmq.ROUTER)  # bound but never answers
    port = router.bind_to_random_port("tcp://127.0.0.1")
    result = replay_from(f"tcp://127.0.0.1:{port}", 0, timeout_s=0.2, ctx=ctx)
    assert not result.complete and result.messages == [] and not result.history_lost
    router.close(linger=0)


def serve_once(router: zmq.Socket[bytes], replies: list[list[bytes]]) -> threading.Thread:
    """A raw ROUTER answering one request with `replies` (each without the identity/delimiter)."""

    def run() -> None:
        identity, _delimiter, _seq = recv_frames(router)
        for reply in replies:
            router.send_multipart([identity, b"", *reply])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_older_vllm_replies_and_bad_frames_are_handled(ctx: Ctx) -> None:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seq = (5).to_bytes(8, "big")
    # Older vLLM: [seq, payload] after the delimiter, no topic; one broken reply in between.
    thread = serve_once(
        router, [[seq, b"p5"], [b"short", b"x"], [(6).to_bytes(8, "big"), b"p6"], [END_SEQ_BYTES, b""]]
    )
    result = replay_from(f"tcp://127.0.0.1:{port}", 5, timeout_s=5.0, ctx=ctx)
    thread.join(5.0)
    assert result.complete and sum(result.bad_frames.values()) == 1
    assert [(m.topic, m.seq, m.payload) for m in result.messages] == [(b"", 5, b"p5"), (b"", 6, b"p6")]
    router.close(linger=0)


def test_a_timed_out_request_does_not_pollute_the_next(ctx: Ctx) -> None:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    first = replay_from(endpoint, 1, timeout_s=0.2, ctx=ctx)  # nobody answers in time
    assert not first.complete
    # Answer the stale request late, then serve the next one properly.
    identity, _, _ = recv_frames(router)
    router.send_multipart([identity, b"", b"", (1).to_bytes(8, "big"), b"stale"])
    thread = serve_once(router, [[b"", (2).to_bytes(8, "big"), b"fresh"], [b"", END_SEQ_BYTES, b""]])
    second = replay_from(endpoint, 2, timeout_s=5.0, ctx=ctx)
    thread.join(5.0)
    assert second.complete and [m.payload for m in second.messages] == [b"fresh"]
    router.close(linger=0)


def test_publisher_with_ctx_instance_default(ctx: Ctx) -> None:
    # Without ctx both sides share zmq.Context.instance(), as vLLM's publisher does.
    with EventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        pub.publish([AllBlocksCleared()], ts=0.0)
        assert pub.flush(5.0)
        assert pub.replay_endpoint is not None
        result = replay_from(pub.replay_endpoint, 0, timeout_s=5.0)
        assert [m.seq for m in result.messages] == [0] and result.complete
