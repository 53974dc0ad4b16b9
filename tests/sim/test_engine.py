"""SimEngine over real sockets: aiohttp client -> HTTP server, ZMQ SUB and DEALER on 127.0.0.1.

Expected hashes come from BlockHasher (itself checked against vLLM's vectors), expected hit lengths from
vLLM's rules (hit capped at len(prompt) - 1 tokens, block aligned).
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import msgspec
import zmq
from kvindex.hashing import BlockHasher
from kvindex.replay.wire import AllBlocksCleared, BlockStored, KVEventBatch
from kvindex.sim.engine import SimEngine, SimEngineConfig

TIMEOUT_S = 10.0
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
TOPIC = "kv@sim-t@m"


def _config(**overrides: object) -> SimEngineConfig:
    settings: dict[str, object] = {
        "pod_id": "sim-t",
        "model": "m",
        "block_size": 4,
        "capacity_blocks": 64,
        "hash_seed": "0",
        "topic": TOPIC,
    }
    settings.update(overrides)
    return SimEngineConfig(**settings)  # type: ignore[arg-type]


def _recv(sock: zmq.Socket[bytes], timeout_s: float = TIMEOUT_S) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise AssertionError(f"nothing received within {timeout_s} s")
    return sock.recv_multipart()


def _replay_all(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int) -> list[list[bytes]]:
    """Every replayed [topic, seq, payload] until the end marker, through a raw DEALER."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    replies = []
    while True:
        empty, topic, seq, payload = _recv(dealer)
        assert empty == b""
        if seq == b"\xff" * 8:
            assert (topic, payload) == (b"", b"")
            break
        replies.append([topic, seq, payload])
    dealer.close()
    return replies


async def _complete(session: aiohttp.ClientSession, engine: SimEngine, body: object) -> tuple[int, dict]:
    async with session.post(f"{engine.http_url}/v1/completions", json=body) as response:
        return response.status, await response.json()


async def _subscribe_live(
    session: aiohttp.ClientSession, engine: SimEngine, sub: zmq.Socket[bytes]
) -> tuple[int, int]:
    """Await the SUB's subscription by sending fresh warm-up prompts until one arrives live.

    Returns (number of warm-up prompts, seq of the last one); later batches arrive in order.
    """
    deadline = time.monotonic() + TIMEOUT_S
    num_warmups = 0
    while time.monotonic() < deadline:
        prompt = [500_000 + 8 * num_warmups + i for i in range(8)]
        num_warmups += 1
        status, _ = await _complete(session, engine, {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        if sub.poll(200):  # ok: bounded wait inside a deadline loop
            break
    else:
        raise AssertionError("the SUB never received a live batch")
    assert engine._publisher is not None and engine._publisher.flush(TIMEOUT_S)
    last_seq = engine.last_published_seq
    assert last_seq == num_warmups - 1
    while True:
        _, seq, _ = _recv(sub)
        if int.from_bytes(seq, "big") == last_seq:
            return num_warmups, last_seq


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_http_requests_publish_live_batches_and_replay_them(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    hasher = BlockHasher(algo="sha256", block_size=4, seed="0")
    prompt = list(range(1, 11))

    async def scenario() -> None:
        engine = SimEngine(_config(), zmq_ctx=ctx)
        await engine.start()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(engine.pub_endpoint)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
                num_warmups, last_warm_seq = await _subscribe_live(session, engine, sub)

                body = {"model": "m", "prompt": prompt, "max_tokens": 3, "return_token_ids": True}
                status, first = await _complete(session, engine, body)
                assert status == 200
                assert first["object"] == "text_completion" and first["model"] == "m"
                assert first["choices"][0]["finish_reason"] == "length"
                assert first["usage"] == {
                    "prompt_tokens": 10,
                    "completion_tokens": 3,
                    "total_tokens": 13,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
                output = first["choices"][0]["token_ids"]
                # 13 tokens, the last one never computed: 12 computed tokens = 3 full blocks.
                expected_hashes = hasher.event_hashes((prompt + output)[:12])
                assert len(expected_hashes) == 3

                topic, seq, payload = _recv(sub)
                assert topic == TOPIC.encode()
                assert int.from_bytes(seq, "big") == last_warm_seq + 1
                batch = DECODER.decode(payload)
                assert batch.data_parallel_rank == 0
                assert all(isinstance(e, BlockStored) for e in batch.events)
                assert [h for e in batch.events for h in e.block_hashes] == expected_hashes  # type: ignore[union-attr]
                assert batch.events[0].parent_block_hash is None  # type: ignore[union-attr]
                live_payloads = {seq: payload}

                status, second = await _complete(session, engine, body)
                assert status == 200
                # Hit capped at len(prompt) - 1 = 9 tokens -> 2 blocks; block 2 is recomputed and re-announced.
                assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
                assert second["choices"][0]["token_ids"] == output
                topic, seq, payload = _recv(sub)
                (restored,) = DECODER.decode(payload).events
                assert isinstance(restored, BlockStored)
                assert restored.block_hashes == expected_hashes[2:]
                assert restored.parent_block_hash == expected_hashes[1]
                live_payloads[seq] = payload

                replayed = _replay_all(ctx, engine.replay_endpoint or "", 0)
                assert [int.from_bytes(s, "big") for _, s, _ in replayed] == list(range(last_warm_seq + 3))
                assert {s: p for t, s, p in replayed if s in live_payloads} == live_payloads
                assert all(t == TOPIC.encode() for t, _, _ in replayed)

                async with session.get(f"{engine.http_url}/metrics") as response:
                    metrics = await response.text()
                assert _metric(metrics, "vllm:prefix_cache_queries_total") == 8 * num_warmups + 20
                assert _metric(metrics, "vllm:prefix_cache_hits_total") == 8
                async with session.get(f"{engine.http_url}/health") as response:
                    assert response.status == 200

                async with session.post(f"{engine.http_url}/reset_prefix_cache") as response:
                    assert (response.status, await response.json()) == (200, {"success": True})
                _, _, payload = _recv(sub)
                assert DECODER.decode(payload).events == [AllBlocksCleared()]
                status, third = await _complete(session, engine, body)
                assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        finally:
            sub.close()
            await engine.stop()

    asyncio.run(scenario())


def test_bad_requests_get_400_and_change_nothing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async def scenario() -> None:
        engine = SimEngine(_config(capacity_blocks=4), zmq_ctx=ctx)
        await engine.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
                for body, field in [
                    ({"model": "m", "prompt": "hello"}, "prompt"),
                    ({"model": "m", "prompt": []}, "prompt"),
                    ({"model": "m", "prompt": [1, -2]}, "prompt"),
                    ({"model": "m", "prompt": [1, True]}, "prompt"),
                    ({"model": "m", "prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
                    ({"model": "m", "prompt": [1, 2], "max_tokens": "3"}, "max_tokens"),
                    ({"model": "other", "prompt": [1, 2]}, "model"),
                    ({"model": "m", "prompt": list(range(17))}, "prompt"),  # needs 5 blocks of 4
                    ([1, 2, 3], "JSON object"),
                ]:
                    status, reply = await _complete(session, engine, body)
                    assert status == 400, body
                    assert field in reply["error"], (body, reply)
                async with session.post(f"{engine.http_url}/v1/completions", data=b"{not json") as response:
                    assert response.status == 400
                    assert "error" in await response.json()
            assert engine.cache.num_requests == 0
            assert engine.cache.num_cached_blocks == 0
            assert engine.last_published_seq is None
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_direct_calls_without_http_and_two_engines_side_by_side(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    hasher = BlockHasher(algo="sha256_cbor", block_size=4, seed="42")
    engines = [
        SimEngine(_config(pod_id=f"sim-{i}", hash_algo="sha256_cbor", hash_seed="42"), zmq_ctx=ctx)
        for i in range(2)
    ]
    for engine in engines:
        engine.open()
    try:
        assert engines[0].pub_endpoint != engines[1].pub_endpoint
        prompt = list(range(100, 117))
        result = engines[0].handle_prompt(prompt, max_tokens=1)
        assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (17, 0, 1)
        assert engines[0].cache.cached_event_hashes() == set(hasher.event_hashes(prompt))
        assert engines[1].cache.cached_event_hashes() == frozenset()
        assert engines[0].handle_prompt(prompt, max_tokens=1).cached_tokens == 16
        assert engines[1].handle_prompt(prompt, max_tokens=1).cached_tokens == 0
        assert engines[0]._publisher is not None and engines[0]._publisher.flush(TIMEOUT_S)
        replayed = _replay_all(ctx, engines[0].replay_endpoint or "", 0)
        # The second request was a full hit of its 4 cacheable blocks: no event, no batch.
        assert [int.from_bytes(s, "big") for _, s, _ in replayed] == [0]
        (stored,) = DECODER.decode(replayed[0][2]).events
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == hasher.event_hashes(prompt)
        assert stored.token_ids == prompt[:16]
    finally:
        for engine in engines:
            engine.close()


def test_engine_dialling_a_bound_subscriber_publishes_under_its_topic(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]

    async def scenario() -> None:
        engine = SimEngine(_config(pub_endpoint=endpoint), zmq_ctx=ctx)
        await engine.start()
        try:
            assert engine.pub_endpoint == endpoint
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
                await _subscribe_live(session, engine, sub)
                status, _ = await _complete(session, engine, {"prompt": list(range(9)), "max_tokens": 1})
                assert status == 200
            topic, _, payload = _recv(sub)
            assert topic == TOPIC.encode()
            assert isinstance(DECODER.decode(payload).events[0], BlockStored)
        finally:
            sub.close()
            await engine.stop()

    asyncio.run(scenario())
