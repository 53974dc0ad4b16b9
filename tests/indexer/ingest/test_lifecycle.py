"""Engine lifecycles the indexer must follow without help: an engine that comes up after kvindex and
bursts before the subscription exists, a restart whose new seqs stay below the old ones with identical
payloads, and a dead replay socket that must not hold back another pod. Real ZMQ on 127.0.0.1; each test
ends with the index equal to what the engines hold."""

from __future__ import annotations

import socket

import zmq
from engines import Engine
from ingest_support import index_matches, status_of
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.wire import BlockStored
from waiting import wait_for

MODEL = ModelConfig(name="m")
QUICK = IngestSettings(
    quiet_probe_after_s=0.3, replay_timeout_s=0.3, replay_retry_base_s=0.05, replay_retry_max_s=0.3
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_engine_that_bursts_before_the_subscription_exists_and_goes_quiet_is_recovered(
    engines: list[Engine],
) -> None:
    """kvindex first; its join finds nobody (retried). The engine then binds and publishes at once,
    before kvindex's SUB has reconnected, and is never heard from again: its ring has everything."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pod = PodConfig("pod-late", pub, "m", replay_endpoint=replay)
    service = IngestService([MODEL], [pod], settings=QUICK)
    service.start()
    try:
        wait_for(lambda: service.counters().replays.get("timeout", 0) >= 1, what="a join that found nobody")
        engine = Engine("pod-late", endpoint=pub, replay_endpoint=replay, bind=True)
        engines.append(engine)
        for _ in range(12):
            engine.store_prompt()
        engine.remove_oldest()
        engine.flush()
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index, [engine]), what="the burst recovered from the ring")
        wait_for(lambda: status_of(service, engine).state == "live", what="live")
        assert not status_of(service, engine).partial_view
    finally:
        service.stop()


def _batch(engine: Engine, n: int) -> BlockStored:
    key = 10_000 * (n + 1)
    return BlockStored(
        block_hashes=[key, key + 1],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_a_restart_that_republishes_fewer_identical_batches_is_not_taken_for_duplicates(
    engines: list[Engine],
) -> None:
    """Old incarnation: seqs 0..39. New one on the same addresses: the same first 30 batches byte for
    byte (same events, same ts), so seq and digest both repeat; only the connection and the ring tell."""
    engine = Engine("pod-a")
    engines.append(engine)
    service = IngestService([MODEL], [engine.pod_config()], settings=QUICK)
    service.start()
    try:
        wait_for(lambda: status_of(service, engine).state == "live", what="live")
        for n in range(40):
            assert engine.publisher.publish([_batch(engine, n)], ts=float(n))
        engine.flush()
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: status_of(service, engine).last_seq == 39, what="old incarnation applied")
        assert index.pod_block_count(engine.ref) == 80
        engine.restart()
        for n in range(30):
            assert engine.publisher.publish([_batch(engine, n)], ts=float(n))
        engine.flush()
        held = {k for n in range(30) for k in _batch(engine, n).block_hashes}
        wait_for(lambda: index.pod_block_count(engine.ref) == len(held), what="old blocks dropped")
        wait_for(lambda: status_of(service, engine).last_seq == 29, what="new incarnation followed")
        assert {k for k in held if index.lookup_ids([k])[0]} == held
        assert service.counters().restarts >= 1
    finally:
        service.stop()


def test_a_dead_replay_socket_holds_back_no_other_pod(engines: list[Engine]) -> None:
    """One worker; pod-dead's ring accepts requests and never answers. pod-b joins and follows its
    stream meanwhile (before, every replay ran on the worker, one after another)."""
    router_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dead = router_ctx.socket(zmq.ROUTER)
    dead.setsockopt(zmq.LINGER, 0)
    dead_port = dead.bind_to_random_port("tcp://127.0.0.1")
    engine_dead = Engine("pod-dead", replay_endpoint=None)
    engine_b = Engine("pod-b")
    engines += [engine_dead, engine_b]
    pods = [
        PodConfig("pod-dead", engine_dead.endpoint, "m", replay_endpoint=f"tcp://127.0.0.1:{dead_port}"),
        engine_b.pod_config(),
    ]
    settings = IngestSettings(num_workers=1, replay_timeout_s=30.0, quiet_probe_after_s=0.3)
    service = IngestService([MODEL], pods, settings=settings)
    service.start()
    try:
        assert dead.poll(10_000), "pod-dead's join request never came"
        for _ in range(5):
            engine_b.store_prompt()
        engine_b.flush()
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index, [engine_b]), what="pod-b followed", timeout_s=10.0)
        assert status_of(service, engine_b).state == "live"
        assert status_of(service, engine_dead).state == "replaying"  # still waiting, and says so
    finally:
        service.stop()
        dead.close(linger=0)
        router_ctx.destroy(linger=0)


def test_events_that_only_a_replay_brought_give_the_pod_an_event_age(engines: list[Engine]) -> None:
    """kvindex's SUB dials a PUB that never sends; the engine's batches reach it only from the ring. A pod
    whose blocks are indexed has had events: its age is a number (it was null, and a router could not
    tell this live pod from one never heard)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    mute = ctx.socket(zmq.PUB)
    mute.setsockopt(zmq.LINGER, 0)
    mute_port = mute.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine("pod-a")
    engines.append(engine)
    for _ in range(3):
        engine.store_prompt()
    engine.flush()
    pod = PodConfig("pod-a", f"tcp://127.0.0.1:{mute_port}", "m", replay_endpoint=engine.replay_endpoint)
    service = IngestService([MODEL], [pod], settings=QUICK)
    service.start()
    try:
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index, [engine]), what="the ring's batches applied")
        wait_for(lambda: status_of(service, engine).state == "live", what="live")
        age = status_of(service, engine).last_event_age_s
        assert age is not None and 0.0 <= age < QUICK.silent_after_s
        health = service.pod_health("pod-a", 0)
        assert health is not None and health.last_event_age_s is not None
    finally:
        service.stop()
        mute.close(linger=0)
        ctx.destroy(linger=0)


def test_a_quiet_engine_is_probed_once_and_ages_into_silent(engines: list[Engine]) -> None:
    """An engine publishes once, then says nothing. The quiet probe finds nothing new: the pod's event age
    keeps growing until it reads silent. (A probe's answer always repeats the last applied batch; when
    that repeat stamped the age, every quiet pod was probed again each quiet period, forever, and its
    age never passed the quiet period, so a hung engine never read silent.)"""
    engine = Engine("pod-a")
    engines.append(engine)
    settings = IngestSettings(quiet_probe_after_s=0.2, silent_after_s=1.0, replay_timeout_s=0.5)
    pod = PodConfig("pod-a", engine.endpoint, "m", replay_endpoint=engine.replay_endpoint)
    service = IngestService([MODEL], [pod], settings=settings)
    service.start()
    try:
        index = service.model("m").index  # type: ignore[union-attr]
        engine.store_prompt()
        engine.flush()
        wait_for(lambda: index_matches(index, [engine]), what="the batch applied")
        wait_for(lambda: status_of(service, engine).state == "silent", what="the quiet pod to read silent")
        status = status_of(service, engine)
        assert status.last_event_age_s is not None and status.last_event_age_s >= settings.silent_after_s
        # The join, the connection's check and one quiet probe; a probe per quiet period would be 5 more.
        assert status.replays_total <= 4, status
    finally:
        service.stop()
