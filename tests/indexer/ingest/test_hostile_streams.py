"""Streams that misbehave, as benchmarks/fuzz.py found them: what the worker must count, and must not let
escape. Raw XPUB sockets on 127.0.0.1 send exactly the frames of each case.

The dp-rank case was a bug in indexer/ingest/worker.py (a template that makes no endpoint for a pod
raised out of the worker): the stream is now made without replay, and that is said once."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import zmq
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import AllBlocksCleared, BlockStored, KVEventBatch
from waiting import wait_for


@pytest.fixture
def xpub(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[zmq.Socket[bytes]]:
    """A PUB that says when the indexer's SUB has subscribed (so nothing sent after that is lost)."""
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    yield sock
    sock.close(linger=0)


def subscribed(sock: zmq.Socket[bytes]) -> None:
    assert sock.poll(10_000), "the indexer never subscribed"
    sock.recv()


def batch(rank: int) -> bytes:
    return encode_batch(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=rank))


def send(sock: zmq.Socket[bytes], topic: str, seq: int, payload: bytes) -> None:
    sock.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])


@pytest.mark.parametrize("template", ["ipc:///tmp/kvindex-{pod}.replay", "tcp://127.0.0.1:{pod}"])
def test_a_batch_naming_dp_rank_1_makes_its_stream_whatever_the_replay_template(
    template: str, xpub: zmq.Socket[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    settings = IngestSettings(listen_replay_template=template, replay_timeout_s=0.2)
    service = IngestService([ModelConfig("m")], listen="tcp://127.0.0.1:*", settings=settings)
    service.start()
    try:
        assert service.listen_endpoint is not None
        xpub.connect(service.listen_endpoint)
        subscribed(xpub)
        send(xpub, "kv@engine-a@m", 0, batch(rank=1))
        send(xpub, "kv@engine-b@m", 0, batch(rank=0))  # same worker, after it: a marker

        def streams() -> set[tuple[str, int]]:
            return {(s.pod, s.dp_rank) for s in service.pod_statuses()}

        wait_for(lambda: ("engine-b", 0) in streams(), what="the marker's stream")
        assert ("engine-a", 1) in streams()
        assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
    finally:
        service.stop()


def test_process_counters_count_the_gaps_and_duplicates_of_live_messages(xpub: zmq.Socket[bytes]) -> None:
    # Found on 1b3d3db (counters().gaps stayed 0: the worker snapshot the tracker after on_live); main's
    # counters now sync from the tracker's totals.
    xpub.bind("tcp://127.0.0.1:0")
    endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
    service = IngestService([ModelConfig("m")], [PodConfig("pod-a", endpoint, "m")])
    service.start()
    try:
        subscribed(xpub)
        wait_for(service.ready, what="joined (no replay socket: at once)")
        for seq in (0, 1, 3, 3):  # seq 2 never comes (a gap), then seq 3 again (a duplicate)
            send(xpub, "", seq, batch(rank=0))
        wait_for(lambda: service.pod_statuses()[0].last_seq == 3, what="seq 3 applied")
        status = service.pod_statuses()[0]
        assert status.gaps_total == 1  # the stream's own count is right
        # The second seq 3 may still be on its way to the worker when the first is applied.
        wait_for(lambda: service.counters().duplicates >= 1, what="the duplicate counted")
        counters = service.counters()
        assert (counters.gaps, counters.duplicates) == (1, 1)
    finally:
        service.stop()


def test_a_pod_whose_topic_names_another_model_moves_to_it(xpub: zmq.Socket[bytes]) -> None:
    """Bind mode: `kv@p@m`, then `kv@p@other` (the engine redeployed with another model): p's blocks
    leave m's index and its new ones land in other's, never in m's."""

    def stored(key: int) -> bytes:
        event = BlockStored(
            block_hashes=[key],
            parent_block_hash=None,
            token_ids=[1] * 16,
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        return encode_batch(KVEventBatch(ts=1.0, events=[event], data_parallel_rank=0))

    service = IngestService([ModelConfig("m"), ModelConfig("other")], listen="tcp://127.0.0.1:*")
    service.start()
    try:
        assert service.listen_endpoint is not None
        xpub.connect(service.listen_endpoint)
        subscribed(xpub)
        index_m = service.model("m").index  # type: ignore[union-attr]
        index_other = service.model("other").index  # type: ignore[union-attr]
        send(xpub, "kv@p@m", 0, stored(111))
        wait_for(lambda: bool(index_m.lookup_ids([111])), what="111 in m")
        send(xpub, "kv@p@other", 0, stored(222))
        wait_for(lambda: bool(index_other.lookup_ids([222])), what="222 in other")
        assert not index_m.lookup_ids([222]) and not index_m.lookup_ids([111])
        assert [(s.pod, s.model) for s in service.pod_statuses()] == [("p", "other")]
    finally:
        service.stop()
