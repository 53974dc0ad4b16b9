"""Batch decoding: vLLM 0.33's recorded batches, older shapes (spec section 7), and damaged events.

Expected domain events come from `reference_event`, written from the event rules (spec 2.2, 4.7):
hashes are unsigned 64-bit ints, raw digests fold to their last 8 bytes big-endian, tier = medium or GPU.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.indexer.decode import DecodeError, decode_batch
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBatch, KVEvent
from replay_support import load_vectors

U64 = 2**64 - 1


# --- reference model ------------------------------------------------------------------------------


def reference_key(value: Any) -> int:
    if isinstance(value, dict):
        value = bytes.fromhex(value["bytes_hex"])
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & U64  # vLLM's maybe_convert_block_hash
    return int(value)


def deep_tuple(value: Any) -> Any:
    """Arrays as tuples; the vectors' {"bytes_hex"} as the bytes msgpack carried (prompt-embeds digests)."""
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes_hex"])
    return tuple(deep_tuple(v) for v in value) if isinstance(value, list) else value


def reference_event(record: dict[str, Any]) -> KVEvent:
    kind = record["type"]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    keys = tuple(reference_key(h) for h in record["block_hashes"])
    tier = record.get("medium") or "GPU"
    if kind == "BlockRemoved":
        return BlocksRemoved(block_keys=keys, tier=tier, group_idx=record.get("group_idx"))
    assert kind == "BlockStored"
    parent = record.get("parent_block_hash")
    extra = record.get("extra_keys")
    lookahead = record.get("lookahead_token_ids")
    return BlocksStored(
        block_keys=keys,
        parent_key=None if parent is None else reference_key(parent),
        token_ids=tuple(record.get("token_ids", ())),
        block_size=record.get("block_size", 0),
        tier=tier,
        lora_name=record.get("lora_name"),
        extra_keys=None if extra is None else tuple(None if not e else deep_tuple(e) for e in extra),
        group_idx=record.get("group_idx"),
        spec_kind=record.get("kv_cache_spec_kind"),
        locality=record.get("locality"),
        lookahead_token_ids=None if lookahead is None else deep_tuple(lookahead),
    )


# --- vLLM 0.33 recorded batches -------------------------------------------------------------------


def test_every_captured_live_and_replayed_payload_decodes_to_its_recorded_fields(
    wire_frames: dict[str, Any],
) -> None:
    messages = wire_frames["live_messages"] + wire_frames["dp_rank_1_default_topic"]["messages"]
    for message in messages:
        ts, events, rank = message["payload"]["generic_msgpack"]
        decoded = decode_batch(bytes.fromhex(message["frames_hex"][-1]))
        assert decoded.dropped == {}
        assert decoded.batch == EventBatch(
            ts=ts, events=tuple(reference_event(e) for e in events), dp_rank=rank
        )
    for reply in wire_frames["replay_dealer_from_seq2"]["reply_messages"][:-1]:
        live = wire_frames["live_messages"][reply["seq_signed"]]
        ts, events, rank = live["payload"]["generic_msgpack"]
        decoded = decode_batch(bytes.fromhex(reply["frames_hex"][3]))
        assert decoded.batch == EventBatch(
            ts=ts, events=tuple(reference_event(e) for e in events), dp_rank=rank
        )


def test_raw_bytes_hash_folds_to_the_int_vllm_publishes(wire_frames: dict[str, Any]) -> None:
    context = wire_frames["hash_context"]
    bytes_message = wire_frames["live_messages"][3]
    stored = decode_batch(bytes.fromhex(bytes_message["frames_hex"][2])).batch.events[1]
    assert isinstance(stored, BlocksStored)
    assert stored.block_keys == (context["event_block_hashes"][0],)


def blockpool_steps(raw: dict[str, Any]) -> list[dict[str, Any]]:
    cases = raw["blockpool_event_cases"] + raw["bytes_event_hashes_run"]["blockpool_event_cases"]
    return [step for case in cases for step in case["steps"] if "batch_payload_hex" in step]


def test_every_recorded_blockpool_batch_decodes(raw_vectors: dict[str, Any]) -> None:
    steps = blockpool_steps(raw_vectors)
    assert len(steps) > 100
    for step in steps:
        decoded = decode_batch(bytes.fromhex(step["batch_payload_hex"]))
        assert decoded.dropped == {}, step["step"]
        assert decoded.batch.events == tuple(reference_event(e) for e in step["events_builtins"]), step[
            "step"
        ]
        assert decoded.batch.ts == 1700000000.25 and decoded.batch.dp_rank == 0


# --- older and partial shapes (spec section 7) ----------------------------------------------------


class EarlyBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class EarlyBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]


class EarlyAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class EarlyEventBatch(msgspec.Struct, array_like=True):
    """vllm@b4e69e0a: `[ts, events]`, every event an array."""

    ts: float
    events: list[EarlyBlockStored | EarlyBlockRemoved | EarlyAllBlocksCleared]


class ArrayStoredWithNewerFields(msgspec.Struct, array_like=True, tag="BlockStored"):
    """The 0.33 field order as an array, plus a field from a release we have not seen."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    locality: str | None
    ownership: str | None
    session_id: str | None
    lookahead_token_ids: list[list[int]] | None
    some_future_field: str


class MapEventBatch(msgspec.Struct):
    """vllm@0181ea31: EventBatch stored without array_like, i.e. a map."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None


def test_early_array_batch_without_rank_decodes() -> None:
    batch = EarlyEventBatch(
        ts=12.5,
        events=[
            EarlyBlockStored([U64, 2**63], None, list(range(32)), 16, None),
            EarlyBlockRemoved([2**63]),
            EarlyAllBlocksCleared(),
        ],
    )
    decoded = decode_batch(msgspec.msgpack.encode(batch))
    assert decoded.dropped == {}
    assert decoded.batch == EventBatch(
        ts=12.5,
        events=(
            BlocksStored(block_keys=(U64, 2**63), parent_key=None, token_ids=tuple(range(32)), block_size=16),
            BlocksRemoved(block_keys=(2**63,)),
            AllBlocksCleared(),
        ),
        dp_rank=None,
    )


def test_array_events_with_more_and_fewer_trailing_fields_decode() -> None:
    digest = b"\x00" * 24 + (9).to_bytes(8, "big")
    longer = ArrayStoredWithNewerFields(
        [7, digest], 3, [1] * 32, 16, None, "CPU", "l", [None, ["l"]], 2,
        "full_attention", None, "LOCAL", "kvcr", "s", [[5], [6]], "later",
    )  # fmt: skip
    shorter = ["BlockStored", [8], None, [1] * 16, 16]  # even lora_id missing
    removed_with_medium = ["BlockRemoved", [8], "CPU", 2]
    decoded = decode_batch(msgspec.msgpack.encode([1.0, [longer, shorter, removed_with_medium], 3]))
    assert decoded.dropped == {}
    assert decoded.batch.dp_rank == 3
    assert decoded.batch.events == (
        BlocksStored(
            block_keys=(7, 9), parent_key=3, token_ids=(1,) * 32, block_size=16, tier="CPU", lora_name="l",
            extra_keys=(None, ("l",)), group_idx=2, spec_kind="full_attention", locality="LOCAL",
            lookahead_token_ids=((5,), (6,)),
        ),
        BlocksStored(block_keys=(8,), parent_key=None, token_ids=(1,) * 16, block_size=16),
        BlocksRemoved(block_keys=(8,), tier="CPU", group_idx=2),
    )  # fmt: skip


def test_map_batch_and_two_element_batch_with_map_events_decode() -> None:
    cleared = {"type": "AllBlocksCleared"}
    removed = {"type": "BlockRemoved", "block_hashes": [2**63 + 5], "medium": None}
    map_batch = MapEventBatch(ts=2.0, events=[removed, cleared], data_parallel_rank=1)
    as_map = decode_batch(msgspec.msgpack.encode(map_batch))
    two = decode_batch(msgspec.msgpack.encode([2.0, [removed, cleared]]))
    expected_events = (BlocksRemoved(block_keys=(2**63 + 5,)), AllBlocksCleared())
    assert as_map.batch == EventBatch(ts=2.0, events=expected_events, dp_rank=1)
    assert two.batch == EventBatch(ts=2.0, events=expected_events, dp_rank=None)
    assert as_map.dropped == two.dropped == {}


def test_map_event_missing_fields_that_033_always_writes_decodes() -> None:
    partial = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [4] * 16}
    decoded = decode_batch(msgspec.msgpack.encode([0.0, [{**partial, "block_size": 16}], 0]))
    assert decoded.batch.events == (reference_event({**partial, "block_size": 16}),)
    assert decoded.dropped == {}


def test_offload_placeholder_and_every_optional_field() -> None:
    placeholder = {
        "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [],
        "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None, "locality": "REMOTE",
        "ownership": "kvcr", "session_id": "abc",
    }  # fmt: skip
    decoded = decode_batch(msgspec.msgpack.encode([0.0, [placeholder], 0]))
    assert decoded.batch.events == (reference_event(placeholder),)
    (event,) = decoded.batch.events
    assert isinstance(event, BlocksStored)
    assert (event.tier, event.token_ids, event.block_size, event.locality) == ("STORAGE", (), 0, "REMOTE")


# --- damaged events and batches -------------------------------------------------------------------


GOOD_STORED = {
    "type": "BlockStored", "block_hashes": [U64 - 1], "parent_block_hash": 17, "token_ids": [1] * 16,
    "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None], "group_idx": 0,
}  # fmt: skip
GOOD_REMOVED = {"type": "BlockRemoved", "block_hashes": [2**63], "medium": "GPU", "group_idx": 0}


def test_bad_events_are_dropped_by_reason_and_the_rest_survive_in_order() -> None:
    events = [
        GOOD_STORED,
        {"type": "BlockFrobbed", "block_hashes": [1]},
        GOOD_REMOVED,
        {**GOOD_STORED, "block_hashes": "not a list"},
        {"type": "AllBlocksCleared"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01\x02"], "medium": "GPU"},  # digest too short
        ["Unknown", 1],
        42,
    ]
    decoded = decode_batch(msgspec.msgpack.encode([5.0, events, 2]))
    assert decoded.batch == EventBatch(
        ts=5.0,
        events=(reference_event(GOOD_STORED), reference_event(GOOD_REMOVED), AllBlocksCleared()),
        dp_rank=2,
    )
    assert decoded.dropped == {"unknown_event_type": 2, "malformed_event": 2, "bad_hash": 1}


def test_bad_hash_in_the_fast_path_drops_only_that_event() -> None:
    short_digest = {**GOOD_REMOVED, "block_hashes": [b"\x01"]}
    decoded = decode_batch(msgspec.msgpack.encode([5.0, [GOOD_STORED, short_digest, GOOD_REMOVED], 0]))
    assert decoded.batch.events == (reference_event(GOOD_STORED), reference_event(GOOD_REMOVED))
    assert decoded.dropped == {"bad_hash": 1}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "not_msgpack"),
        (b"\xc1", "not_msgpack"),
        (msgspec.msgpack.encode([1.0, []]) + b"\x00", "not_msgpack"),
        (msgspec.msgpack.encode({"a": 1}), "bad_batch"),
        (msgspec.msgpack.encode([1.0]), "bad_batch"),
        (msgspec.msgpack.encode(["ts", []]), "bad_batch"),
        (msgspec.msgpack.encode([1.0, {}, 0]), "bad_batch"),
        (msgspec.msgpack.encode([1.0, [], "rank"]), "bad_batch"),
        (msgspec.msgpack.encode("text"), "bad_batch"),
    ],
)
def test_unreadable_batches_raise_decode_error_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


# --- property tests -------------------------------------------------------------------------------

hashes = st.one_of(st.integers(0, U64), st.binary(min_size=32, max_size=32))


def stored_event(
    hs: list[Any], parent: Any, tokens: list[int], medium: str | None, group: int
) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": [None] * len(hs),
        "group_idx": group,
    }  # fmt: skip


def removed_event(hs: list[Any], medium: str | None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hs, "medium": medium}


good_events = st.one_of(
    st.builds(
        stored_event,
        st.lists(hashes, min_size=1, max_size=4),
        st.one_of(st.none(), hashes),
        st.lists(st.integers(0, 200_000), max_size=64),
        st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
        st.integers(0, 3),
    ),
    st.builds(removed_event, st.lists(hashes, min_size=1, max_size=4), st.sampled_from([None, "GPU", "CPU"])),
    st.just({"type": "AllBlocksCleared"}),
)
msgpack_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), U64), st.text(max_size=8), st.binary(max_size=8)
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
bad_events = st.one_of(
    msgpack_values,
    st.builds(
        lambda tag, body: {**body, "type": tag},
        st.text(max_size=12),
        st.dictionaries(st.text(max_size=8), msgpack_values, max_size=3),
    ),
    st.builds(
        lambda event, key, value: {**event, key: value},
        good_events,
        st.sampled_from(["block_hashes", "token_ids", "medium", "type"]),
        msgpack_values,
    ),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(good_events, max_size=6), bad_events, st.integers(0, 6))
def test_one_bad_event_never_costs_the_good_ones(good: list[dict[str, Any]], bad: Any, position: int) -> None:
    position = min(position, len(good))
    events = [*good[:position], bad, *good[position:]]
    decoded = decode_batch(msgspec.msgpack.encode([3.0, events, 1]))
    expected = tuple(reference_event(e) for e in good)
    got = decoded.batch.events
    if len(got) == len(expected) + 1:  # the "bad" event happened to be a valid one
        got = got[:position] + got[position + 1 :]
        assert decoded.dropped == {}
    else:
        assert sum(decoded.dropped.values()) == 1
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_payloads_raise_nothing_but_decode_error(payload: bytes) -> None:
    try:
        decode_batch(payload)
    except DecodeError:
        pass


_RAW = load_vectors("vllm-0.33.0-raw-vectors.json")
_VECTOR_PAYLOADS = [bytes.fromhex(step["batch_payload_hex"]) for step in blockpool_steps(_RAW)[:20]]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(_VECTOR_PAYLOADS), st.data())
def test_truncated_or_flipped_payloads_raise_nothing_but_decode_error(
    payload: bytes, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(DecodeError):
        decode_batch(payload[:cut])
    index = data.draw(st.integers(0, len(payload) - 1))
    flipped = (
        payload[:index] + bytes([payload[index] ^ data.draw(st.integers(1, 255))]) + payload[index + 1 :]
    )
    try:
        decode_batch(flipped)
    except DecodeError:
        pass


def test_skipping_token_ids_changes_nothing_else(raw_vectors: dict[str, Any]) -> None:
    for step in blockpool_steps(raw_vectors):
        payload = bytes.fromhex(step["batch_payload_hex"])
        full, skipped = decode_batch(payload), decode_batch(payload, with_token_ids=False)
        assert skipped.dropped == {}
        expected = tuple(
            msgspec.structs.replace(e, token_ids=()) if isinstance(e, BlocksStored) else e
            for e in full.batch.events
        )
        assert skipped.batch.events == expected


@pytest.mark.parametrize(
    "hashes",
    [
        [0, 2**64 - 1, 2**63],  # vLLM's default: the ingest hot path
        [-1, -(2**63)],  # signed 64-bit producer: folded on the general path
        [b"\x00" * 24 + (7).to_bytes(8, "big"), 5],  # raw digests (mixed with an int)
        [],
    ],
)
def test_without_token_ids_every_hash_form_decodes_like_the_full_path(hashes: list[Any]) -> None:
    lookahead = {**GOOD_STORED, "lookahead_token_ids": [[1, 2]], "extra_keys": [["lora", 3]], "medium": None}
    events = [
        {**GOOD_STORED, "block_hashes": hashes, "parent_block_hash": hashes[0] if hashes else None},
        {**lookahead, "block_hashes": hashes},
        {**GOOD_REMOVED, "block_hashes": hashes, "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ]
    payload = msgspec.msgpack.encode([3.0, events, 1])
    full, skipped = decode_batch(payload), decode_batch(payload, with_token_ids=False)
    assert full.dropped == skipped.dropped == {}
    if all(isinstance(h, int) and h >= 0 for h in hashes):
        assert full.batch.events == tuple(reference_event(e) for e in events)
    expected = tuple(
        msgspec.structs.replace(e, token_ids=()) if isinstance(e, BlocksStored) else e
        for e in full.batch.events
    )
    assert skipped.batch == EventBatch(ts=3.0, events=expected, dp_rank=1)


# --- nesting: msgspec raises RecursionError (not one of its own errors) past ~1,000 levels --------------


def nested_array(depth: int, leaf: bytes = b"\x01") -> bytes:
    """`depth` one-element msgpack arrays around `leaf`: one byte per level."""
    return b"\x91" * depth + leaf


@pytest.mark.parametrize("with_token_ids", [True, False])
def test_a_batch_nested_beyond_the_recursion_limit_is_a_decode_error(with_token_ids: bool) -> None:
    ts = msgspec.msgpack.encode(1.0)
    deep_event_in_array_batch = b"\x93" + ts + b"\x91" + nested_array(100_000) + b"\x00"
    deep_event_in_map_batch = (
        b"\x82" + msgspec.msgpack.encode("ts") + ts + msgspec.msgpack.encode("events") + b"\x91"
    ) + nested_array(100_000)
    for payload in (deep_event_in_array_batch, deep_event_in_map_batch):
        with pytest.raises(DecodeError) as info:
            decode_batch(payload, with_token_ids=with_token_ids)
        assert info.value.reason == "too_deep"


@pytest.mark.parametrize("depth", [40, 600])
@pytest.mark.parametrize("with_token_ids", [True, False])
def test_extra_keys_nested_too_deep_drop_only_their_event(depth: int, with_token_ids: bool) -> None:
    # Before: convert's recursive freeze raised RecursionError out of decode_batch past ~500 levels.
    deep: Any = 1
    for _ in range(depth):
        deep = [deep]
    events = [{**GOOD_STORED, "extra_keys": [deep]}, GOOD_REMOVED]
    decoded = decode_batch(msgspec.msgpack.encode([3.0, events, 0]), with_token_ids=with_token_ids)
    assert decoded.dropped == {"too_deep": 1}
    assert decoded.batch.events == (reference_event(GOOD_REMOVED),)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_payloads_without_token_ids_raise_nothing_but_decode_error(payload: bytes) -> None:
    # The ingest worker's mode: the hot decoder first, then the general path.
    try:
        decode_batch(payload, with_token_ids=False)
    except DecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(msgpack_values, st.booleans())
def test_any_msgpack_value_as_batch_or_event_raises_nothing_but_decode_error(
    value: Any, with_token_ids: bool
) -> None:
    for payload in (msgspec.msgpack.encode(value), msgspec.msgpack.encode([1.0, [value, value], 0])):
        try:
            decode_batch(payload, with_token_ids=with_token_ids)
        except DecodeError:
            pass
