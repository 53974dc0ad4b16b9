"""Engine -> sidecar over real ZMQ: the downstream stream is vLLM's protocol carrying the engine's own
payloads, byte for byte and field by field (read back with kvindex's vLLM-compatible decoder), under the
sidecar's own seq, which an engine restart does not reset (one AllBlocksCleared marks it)."""

from __future__ import annotations

import zmq
from engines import Engine
from kvindex.indexer.decode import decode_batch
from kvindex.indexer.events import AllBlocksCleared, BlocksStored
from kvindex.replay.frames import parse_live
from kvindex.replay.replay_client import replay_from
from sidecar_support import RunningSidecar
from waiting import wait_for


def engine_payloads(engine: Engine) -> list[bytes]:
    """What the engine itself sent, from its own replay ring (seq 0 on)."""
    result = replay_from(engine.replay_endpoint or "", 0, timeout_s=5.0)
    assert result.complete and [m.seq for m in result.messages] == list(range(len(result.messages)))
    return [m.payload for m in result.messages]


def downstream(sidecar: RunningSidecar) -> list[tuple[int, bytes]]:
    result = replay_from(sidecar.replay_endpoint or "", 0, timeout_s=5.0)
    assert result.complete
    return [(m.seq, m.payload) for m in result.messages]


def publish_mix(engine: Engine, n: int) -> None:
    """Prompts with real hashes, an eviction, a CPU-tier copy, extra keys: the event shapes vLLM sends."""
    for i in range(n):
        engine.store_prompt(num_blocks=1 + i % 3)
        if i % 4 == 3:
            engine.remove_oldest()
    engine.store([7001, 7002], list(range(32)), block_size=16, tier="CPU", extra_keys=[["lora", 3], None])
    engine.flush()


def test_downstream_carries_the_engines_payloads_under_its_own_seq(engines: list[Engine]) -> None:
    engines.append(Engine("pod-a"))
    engine = engines[0]
    publish_mix(engine, 12)  # before the sidecar: its join replays the engine's ring
    sidecar = RunningSidecar(engine)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    sub.connect(sidecar.endpoint)
    try:
        expected = engine_payloads(engine)
        wait_for(lambda: sidecar.downstream_seq() == len(expected) - 1, what="the joined history downstream")
        # Live: published once the downstream SUB is connected (retried until its subscription lands).
        live: list[list[bytes]] = []

        def one_live_batch() -> bool:
            if sub.poll(50):
                live.append(sub.recv_multipart())
                return True
            engine.store_prompt()
            return False

        wait_for(one_live_batch, what="a live batch downstream")
        engine.flush()
        expected = engine_payloads(engine)
        wait_for(lambda: sidecar.downstream_seq() == len(expected) - 1, what="every engine batch downstream")
        got = downstream(sidecar)
        assert [seq for seq, _ in got] == list(range(len(expected)))
        assert [payload for _, payload in got] == expected  # byte for byte
        for (_, payload), engine_payload in zip(got, expected, strict=True):
            ours, theirs = decode_batch(payload), decode_batch(engine_payload)
            assert ours.batch == theirs.batch and not ours.dropped  # field by field: tokens, extra keys, tier
        message = parse_live(live[0])
        assert message.topic == b"kv@pod-a@m"
        assert message.payload == expected[message.seq]
        status = sidecar.service.status().ranks[0]
        # Every prompt the engine stored (GPU, real hashes); the CPU store with extra keys cannot be checked.
        firsts = [decode_batch(p).batch.events[0] for p in expected]
        prompts = [e for e in firsts if isinstance(e, BlocksStored) and e.tier == "GPU"]
        assert status.hash_checks_total == len(prompts)
        assert status.hash_mismatches_total == 0 and status.hash_check == "ok"
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)
        sidecar.close()


def test_engine_restart_is_one_all_blocks_cleared_and_the_seq_goes_on(engines: list[Engine]) -> None:
    engines.append(Engine("pod-a"))
    engine = engines[0]
    sidecar = RunningSidecar(engine)
    try:
        wait_for(lambda: sidecar.service.ready()[0], what="the sidecar joined its engine")
        publish_mix(engine, 6)
        before = engine_payloads(engine)
        wait_for(lambda: sidecar.downstream_seq() == len(before) - 1, what="the first incarnation downstream")
        engine.restart()
        publish_mix(engine, 5)
        after = engine_payloads(engine)
        total = len(before) + 1 + len(after)
        wait_for(lambda: sidecar.downstream_seq() == total - 1, what="the new incarnation downstream")
        got = downstream(sidecar)
        assert [seq for seq, _ in got] == list(range(total))  # never reset, no hole
        payloads = [payload for _, payload in got]
        assert payloads[: len(before)] == before and payloads[len(before) + 1 :] == after
        cleared = decode_batch(payloads[len(before)]).batch
        assert cleared.events == (AllBlocksCleared(),) and cleared.dp_rank == 0
        assert sidecar.service.status().ranks[0].relay.restarts == 1
        snapshot = sidecar.service.snapshot()
        held = {key for tier in snapshot.ranks[0].tiers for key in tier.block_hashes}
        assert held == set(engine.held) and snapshot.ranks[0].seq == total - 1
    finally:
        sidecar.close()
