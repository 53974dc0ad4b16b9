"""The compiled batch reader (indexer/_payload.c): a batch without its token ids must hold exactly what the
original holds, token ids aside, and decode's hot path must give the same events from it; anything that
is not a batch it can read is left to the original (None), never misread and never a crash."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_cores import require_payload_extension
from kvindex.indexer import compiled
from kvindex.indexer.decode import DecodeError, decode_batch
from replay_support import load_vectors

from benchmarks.workload import WorkloadSpec, build_workload, encode_engine

pytestmark = pytest.mark.timeout(120)

WithoutTokenIds = Callable[..., bytes | None]  # the extension's function


def require_extension() -> WithoutTokenIds:
    return require_payload_extension()


def expected(payload: bytes) -> Any:
    """The reference: the original decoded, each map event's token_ids set to []."""
    batch = msgspec.msgpack.decode(payload)
    for event in batch[1]:
        if isinstance(event, dict) and "token_ids" in event:
            event["token_ids"] = []
    return batch


def has_token_ids(batch: list[Any]) -> bool:
    return any(isinstance(event, dict) and "token_ids" in event for event in batch[1])


def readable_outline(payload: bytes) -> bool:
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return False
    return isinstance(batch, list) and len(batch) in (2, 3) and isinstance(batch[1], list)


def recorded_payloads() -> list[bytes]:
    frames = load_vectors("vllm-0.33.0-wire-frames.json")
    messages = frames["live_messages"] + frames["dp_rank_1_default_topic"]["messages"]
    payloads = [bytes.fromhex(m["frames_hex"][-1]) for m in messages]
    payloads += [
        bytes.fromhex(r["frames_hex"][-1]) for r in frames["replay_dealer_from_seq2"]["reply_messages"][:-1]
    ]
    workload = build_workload(WorkloadSpec(num_engines=3, blocks_per_engine=300, num_queries=1))
    payloads += [p for engine in workload.engines for p in encode_engine(engine)]
    return payloads


def decoded_both_ways(payload: bytes, patch: pytest.MonkeyPatch, without: WithoutTokenIds) -> tuple[Any, Any]:
    def decode() -> Any:
        try:
            return decode_batch(payload, with_token_ids=False)
        except DecodeError as exc:
            return ("DecodeError", exc.reason)

    patch.setattr(compiled, "without_token_ids", None)
    original = decode()
    patch.setattr(compiled, "without_token_ids", lambda data: without(data, 0))
    return original, decode()


def test_recorded_and_benchmark_batches_lose_only_their_token_ids() -> None:
    without = require_extension()
    slimmed = 0
    for payload in recorded_payloads():
        slim = without(payload, 0)
        if not has_token_ids(msgspec.msgpack.decode(payload)):
            assert slim is None  # nothing to take out: decode the original
            continue
        assert slim is not None and len(slim) < len(payload)
        assert msgspec.msgpack.decode(slim) == expected(payload)
        slimmed += 1
    assert slimmed >= 10


def test_decode_gives_the_same_events_with_and_without_the_reader() -> None:
    without = require_extension()
    with pytest.MonkeyPatch.context() as patch:
        for payload in recorded_payloads():
            original, slim = decoded_both_ways(payload, patch, without)
            assert slim == original


def test_small_and_unreadable_payloads_are_left_to_the_original() -> None:
    without = require_extension()
    payload = recorded_payloads()[0]
    assert without(payload) is None if len(payload) < 1024 else without(payload) is not None
    assert without(payload, len(payload) + 1) is None
    for bad in (b"", b"\xc1", payload[:-1], payload + b"\x00", b"\x92\xcb" + b"\x00" * 8 + b"\x01"):
        assert without(bad, 0) is None
    no_tokens = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}], 0])
    assert without(no_tokens, 0) is None  # nothing to take out: decode the original
    with pytest.raises(TypeError):
        without("not bytes")  # type: ignore[arg-type]


# Values a field may hold, token ids included: every msgpack type msgspec writes, nested.
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=300) | values
event_keys = st.sampled_from(
    ["type", "block_hashes", "parent_block_hash", "block_size", "medium", "lora_name"]
)
map_events = st.dictionaries(event_keys | st.text(max_size=10), values, max_size=8).flatmap(
    lambda fields: st.one_of(st.just(fields), token_ids.map(lambda ids: {**fields, "token_ids": ids}))
)
events = st.lists(map_events | st.lists(values, max_size=6) | values, max_size=8)
batches = st.tuples(st.floats(allow_nan=False), events, st.none() | st.integers(0, 8)).flatmap(
    lambda batch: st.sampled_from([list(batch), list(batch[:2])])
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches)
def test_any_batch_loses_exactly_its_map_events_token_ids(batch: list[Any]) -> None:
    without = require_extension()
    payload = msgspec.msgpack.encode(batch)
    slim = without(payload, 0)
    if not has_token_ids(batch):
        assert slim is None
        return
    assert slim is not None
    assert msgspec.msgpack.decode(slim) == expected(payload)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_damaged_batches_are_never_misread(cut: int, flips: list[tuple[int, int]]) -> None:
    without = require_extension()
    payloads = recorded_payloads()
    damaged = bytearray(payloads[cut % len(payloads)])
    for position, value in flips:
        damaged[position % len(damaged)] = value
    payload = bytes(damaged[: len(damaged) - cut % 7])
    slim = without(payload, 0)
    # (the reader checks structure, not UTF-8: a copy may exist of a batch msgspec refuses, and then the
    # hot decoder refuses the copy too, as the same bytes are in it; decode's answer is what matters)
    if slim is not None and readable_outline(payload):
        assert msgspec.msgpack.decode(slim) == expected(payload)
    with pytest.MonkeyPatch.context() as patch:
        original, through_reader = decoded_both_ways(payload, patch, without)
        assert through_reader == original


def test_random_bytes_never_crash_the_reader() -> None:
    without = require_extension()
    rng = random.Random(14)
    for _ in range(3_000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        slim = without(b"\x93" + data, 0)
        if slim is not None and readable_outline(b"\x93" + data):
            assert msgspec.msgpack.decode(slim) == expected(b"\x93" + data)
