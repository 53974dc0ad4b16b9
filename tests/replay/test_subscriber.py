"""The subscriber's poller over real PUB/SUB sockets on 127.0.0.1: every message of every socket arrives,
in order, with each connection's link event before its messages, also where the sockets' epoll FDs would
not signal again (a backlog from before the poller started, a socket left at its per-pass batch limit)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from kvindex.replay.subscriber import MAX_BATCH_PER_SOCKET, Subscriber
from waiting import wait_for

Ctx = zmq.Context[zmq.Socket[bytes]]


class Received:
    """What the subscriber handed on, per source, in arrival order (link events as strings)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_source: dict[str, list[object]] = {}

    def on_frames(self, source_id: str, frames: list[bytes]) -> None:
        with self.lock:
            self.by_source.setdefault(source_id, []).append(tuple(frames))

    def on_link(self, source_id: str, event: str) -> None:
        with self.lock:
            self.by_source.setdefault(source_id, []).append(event)

    def messages(self, source_id: str) -> list[object]:
        with self.lock:
            return [item for item in self.by_source.get(source_id, []) if isinstance(item, tuple)]

    def items(self, source_id: str) -> list[object]:
        with self.lock:
            return list(self.by_source.get(source_id, []))


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.term()


def bound_pubs(ctx: Ctx, count: int) -> list[tuple[zmq.Socket[bytes], str]]:
    pubs = []
    for _ in range(count):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind("tcp://127.0.0.1:*")
        pubs.append((pub, pub.getsockopt_string(zmq.LAST_ENDPOINT)))
    return pubs


PROBE = (b"probe",)


def message(source: int, number: int) -> tuple[bytes, bytes, bytes]:
    return (b"kv", number.to_bytes(8, "big"), f"{source}:{number}".encode())


def numbered(received: Received, source_id: str) -> list[object]:
    return [item for item in received.messages(source_id) if item != PROBE]


def until_subscribed(pub: zmq.Socket[bytes], received: Received, source_id: str) -> None:
    """Probe until one arrives: a PUB drops what it sends before the SUB's subscription reaches it."""

    def probed() -> bool:
        if received.messages(source_id):
            return True
        pub.send_multipart(PROBE)
        return False

    wait_for(probed, what=f"{source_id}'s subscription at its PUB", poll_s=0.02)


def test_every_socket_delivers_every_message_in_order_after_its_link_event(ctx: Ctx) -> None:
    received = Received()
    subscriber = Subscriber(received.on_frames, received.on_link, ctx=ctx)  # type: ignore[arg-type]
    pubs = bound_pubs(ctx, 40)
    for index, (_, endpoint) in enumerate(pubs):
        subscriber.add_connect(f"pod-{index}", endpoint)
    subscriber.start()
    try:
        for index, (pub, _) in enumerate(pubs):
            until_subscribed(pub, received, f"pod-{index}")
        rounds = 30
        for number in range(rounds):
            for index, (pub, _) in enumerate(pubs):
                pub.send_multipart(message(index, number))
        wanted = {f"pod-{i}": [message(i, n) for n in range(rounds)] for i in range(len(pubs))}
        wait_for(lambda: all(numbered(received, pod) == frames for pod, frames in wanted.items()), what="all")
        for pod in wanted:
            assert received.items(pod)[0] == "connected"
    finally:
        assert subscriber.stop()
        for pub, _ in pubs:
            pub.close()


def test_a_burst_past_the_batch_limit_is_read_to_the_end_without_more_traffic(ctx: Ctx) -> None:
    """Once the poller has read MAX_BATCH_PER_SOCKET messages of one socket it moves on, and that socket's FD
    need not signal again: the rest must still arrive though nothing more is ever sent."""
    received = Received()
    subscriber = Subscriber(received.on_frames, received.on_link, ctx=ctx)  # type: ignore[arg-type]
    (pub, endpoint), (quiet_pub, quiet_endpoint) = bound_pubs(ctx, 2)
    subscriber.add_connect("busy", endpoint)
    subscriber.add_connect("quiet", quiet_endpoint)
    subscriber.start()
    try:
        until_subscribed(pub, received, "busy")
        burst = 5 * MAX_BATCH_PER_SOCKET + 7
        for number in range(burst):
            pub.send_multipart(message(0, number))
        wanted = [message(0, n) for n in range(burst)]
        wait_for(lambda: numbered(received, "busy") == wanted, what="the whole burst")
    finally:
        assert subscriber.stop()
        pub.close()
        quiet_pub.close()


def test_a_backlog_queued_before_the_poller_started_is_read(ctx: Ctx) -> None:
    """Messages that reached a SUB before the poller ran (its FD signalled before it was watched) arrive
    once it starts, with nothing more sent."""
    received = Received()
    subscriber = Subscriber(received.on_frames, received.on_link, ctx=ctx)  # type: ignore[arg-type]
    ((pub, endpoint),) = bound_pubs(ctx, 1)
    subscriber.add_connect("early", endpoint)
    backlog = 3 * MAX_BATCH_PER_SOCKET
    sent = 0

    def backlogged() -> bool:  # a connecting SUB subscribes on its own: some of these reach it
        nonlocal sent
        for _ in range(backlog):
            pub.send_multipart(message(0, sent))
            sent += 1
        return sent >= 20 * backlog

    wait_for(backlogged, what="a backlog sent", poll_s=0.02)
    subscriber.start()
    try:
        wait_for(lambda: numbered(received, "early")[-1:] == [message(0, sent - 1)], what="the last message")
        arrived = numbered(received, "early")
        first = int.from_bytes(arrived[0][1], "big")  # type: ignore[index]
        assert arrived == [message(0, n) for n in range(first, sent)]
    finally:
        assert subscriber.stop()
        pub.close()
