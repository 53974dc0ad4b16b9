"""The compiled batch reader (indexer/_payload.c). `without_token_ids`: a batch without its token ids must
hold exactly what the original holds, token ids aside, and decode's hot path must give the same events
from it. `read_events`: the events it builds must be exactly those msgspec's path builds. Anything either
cannot read is left to the original (None), never misread and never a crash."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest
from extensions import require_built
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_cores import require_payload_extension
from kvindex.indexer import compiled
from kvindex.indexer.compiled import EventReader
from kvindex.indexer.convert import ConvertError
from kvindex.indexer.decode import (
    DecodeError,
    EventError,
    decode_batch,
    decode_event,
    raw_event,
    raw_events,
    read_default_shapes,
    stored_token_ids,
)
from kvindex.indexer.events import TIER_GPU, AllBlocksCleared, BlocksRemoved, BlocksStored
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import BlockStored, KVEventBatch
from replay_support import load_vectors

from benchmarks.workload import WorkloadSpec, build_workload, encode_engine

pytestmark = pytest.mark.timeout(120)

WithoutTokenIds = Callable[..., bytes | None]  # the extension's function


ALL_BLOCKS_CLEARED = AllBlocksCleared()


def require_extension() -> WithoutTokenIds:
    return require_payload_extension()


def require_event_reader() -> EventReader:
    return require_built(compiled.load_event_reader(), "kvindex.indexer._payload", "a C compiler")


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


# damaged_payload's arguments, and the settings every test over damaged batches runs with.
CUTS = st.integers(0, 10_000)
FLIPS = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4)
over_damaged_batches = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def damaged_payload(cut: int, flips: list[tuple[int, int]]) -> bytes:
    """A recorded payload (picked by `cut`) with bytes overwritten at `flips` and up to 6 bytes cut off."""
    payloads = recorded_payloads()
    damaged = bytearray(payloads[cut % len(payloads)])
    for position, value in flips:
        damaged[position % len(damaged)] = value
    return bytes(damaged[: len(damaged) - cut % 7])


def decode_or_reason(payload: bytes) -> Any:
    try:
        return decode_batch(payload, with_token_ids=False)
    except DecodeError as exc:
        return ("DecodeError", exc.reason)


def decoded_both_ways(payload: bytes, patch: pytest.MonkeyPatch, without: WithoutTokenIds) -> tuple[Any, Any]:
    """decode's answer from msgspec alone, and through without_token_ids (read_events off for both)."""
    patch.setattr(compiled, "read_events", None)
    patch.setattr(compiled, "without_token_ids", None)
    original = decode_or_reason(payload)
    patch.setattr(compiled, "without_token_ids", lambda data: without(data, 0))
    return original, decode_or_reason(payload)


def read_both_ways(payload: bytes, patch: pytest.MonkeyPatch) -> tuple[Any, Any, bool]:
    """decode's answer from msgspec alone, then with both readers on, and whether read_events read it."""
    reader = require_event_reader()
    patch.setattr(compiled, "read_events", None)
    patch.setattr(compiled, "without_token_ids", None)
    original = decode_or_reason(payload)
    patch.setattr(compiled, "read_events", reader)
    patch.setattr(compiled, "without_token_ids", compiled.load_payload_extension())
    read = reader(payload, BlocksStored, BlocksRemoved, ALL_BLOCKS_CLEARED, TIER_GPU) is not None
    return original, decode_or_reason(payload), read


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


@over_damaged_batches
@given(
    cut=CUTS,
    flips=FLIPS,
)
def test_damaged_batches_are_never_misread(cut: int, flips: list[tuple[int, int]]) -> None:
    without = require_extension()
    payload = damaged_payload(cut, flips)
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


# --- read_events ------------------------------------------------------------------------------------


def test_read_events_builds_exactly_what_msgspec_builds_from_recorded_and_benchmark_batches() -> None:
    read = 0
    with pytest.MonkeyPatch.context() as patch:
        for payload in recorded_payloads():
            original, through_reader, was_read = read_both_ways(payload, patch)
            assert through_reader == original
            read += was_read
    assert read >= 10  # vLLM's own default batches take the reader, not only the benchmark's


def default_event(**fields: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(fields)
    return {key: value for key, value in event.items() if value is not DROP}


DROP = object()


@pytest.mark.parametrize(
    ("case", "event", "reads"),
    [
        ("default", default_event(), True),
        (
            "every optional field",
            default_event(
                extra_keys=[None, []],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=None,
                locality="local",
                ownership="own",
                session_id="s",
                lookahead_token_ids=None,
            ),
            True,
        ),
        (
            "CPU tier, LoRA name, parent",
            default_event(medium="CPU", lora_name="a", parent_block_hash=7),
            True,
        ),
        ("empty medium is GPU", default_event(medium=""), True),
        ("nil medium is GPU", default_event(medium=None), True),
        ("removed", {"type": "BlockRemoved", "block_hashes": [3], "medium": None, "group_idx": 1}, True),
        ("cleared", {"type": "AllBlocksCleared"}, True),
        ("tag not first", dict(reversed(list(default_event().items()))), False),
        ("unknown field", default_event(new_field=1), False),
        ("missing required field", default_event(lora_id=DROP), False),
        ("negative hash", default_event(block_hashes=[-1]), False),
        ("raw digest hash", default_event(block_hashes=[b"\x00" * 32]), False),
        ("extra keys with a value", default_event(extra_keys=[["lora"], None]), False),
        ("lookahead tokens", default_event(lookahead_token_ids=[[1], [2]]), False),
        ("bool block size", default_event(block_size=True), False),
        ("unknown tag", {"type": "BlockMoved", "block_hashes": [1]}, False),
        ("cleared with a field", {"type": "AllBlocksCleared", "medium": "GPU"}, False),
        (
            "removed with a stored field",
            {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "block_size": 16},
            False,
        ),
    ],
)
def test_read_events_reads_the_default_shape_and_declines_the_rest(
    case: str, event: Any, reads: bool
) -> None:
    payload = msgspec.msgpack.encode([1.5, [event, default_event()], 3])
    with pytest.MonkeyPatch.context() as patch:
        original, through_reader, was_read = read_both_ways(payload, patch)
    assert through_reader == original, case
    assert was_read is reads, case


def test_read_events_declines_strings_that_are_not_utf8_and_other_batch_shapes() -> None:
    reader = require_event_reader()
    payload = msgspec.msgpack.encode([1.0, [default_event(lora_name="ab")], 0])
    bad_utf8 = payload.replace(b"\xa2ab", b"\xa2\xff\xfe")
    other_shapes = [
        [1, [default_event()], 0],  # an int ts
        [1.0, [default_event()], True],  # a bool rank
        [1.0, [default_event()], 0, 0],  # a fourth item
        [1.0],
        {"ts": 1.0, "events": []},
    ]
    for bad in (
        b"",
        b"\xc1",
        payload[:-1],
        payload + b"\x00",
        bad_utf8,
        *map(msgspec.msgpack.encode, other_shapes),
    ):
        assert reader(bad, BlocksStored, BlocksRemoved, ALL_BLOCKS_CLEARED, TIER_GPU) is None
        with pytest.MonkeyPatch.context() as patch:
            original, through_reader, _ = read_both_ways(bad, patch)
        assert through_reader == original
    with pytest.raises(TypeError):
        reader("not bytes", BlocksStored, BlocksRemoved, ALL_BLOCKS_CLEARED, TIER_GPU)  # type: ignore[arg-type]


# Per field: values of its own type (most events are then the default shape, and read); now and then
# anything else, a missing or unknown field, or another order (declined, and msgspec's path decodes).
_U64 = st.integers(0, 2**64 - 1)
_OPT_STR = st.none() | st.text(max_size=8) | st.sampled_from(["GPU", "CPU", "full_attention", ""])
_OPT_INT = st.none() | st.integers(-(2**63), 2**64 - 1)
FIELD_VALUES: dict[str, Any] = {
    "block_hashes": st.lists(_U64, max_size=20),
    "parent_block_hash": st.none() | _U64,
    "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=64),
    "block_size": st.integers(-(2**63), 2**64 - 1),
    "lora_id": _OPT_INT,
    "medium": _OPT_STR,
    "lora_name": _OPT_STR,
    "extra_keys": st.none() | st.lists(st.none() | st.just([]), max_size=6),
    "group_idx": _OPT_INT,
    "kv_cache_spec_kind": _OPT_STR,
    "kv_cache_spec_sliding_window": _OPT_INT,
    "locality": _OPT_STR,
    "ownership": _OPT_STR,
    "session_id": _OPT_STR,
    "lookahead_token_ids": st.none(),
}
REQUIRED = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}
OPTIONAL = {
    "BlockStored": sorted(set(FIELD_VALUES) - set(REQUIRED["BlockStored"])),
    "BlockRemoved": ["group_idx", "locality", "ownership"],
    "AllBlocksCleared": [],
}


def rarely(draw: st.DrawFn) -> bool:
    return draw(st.integers(0, 39)) == 0


@st.composite
def typed_events(draw: st.DrawFn) -> dict[str, Any]:
    tag = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    names = [name for name in REQUIRED[tag] if not rarely(draw)]
    names += draw(st.lists(st.sampled_from(OPTIONAL[tag]), unique=True)) if OPTIONAL[tag] else []
    if rarely(draw):
        names.append(draw(st.sampled_from(sorted(FIELD_VALUES)) | st.text(max_size=6)))
    event: dict[str, Any] = {"type": draw(st.text(max_size=12)) if rarely(draw) else tag}
    for name in names:
        event[name] = draw(values) if rarely(draw) or name not in FIELD_VALUES else draw(FIELD_VALUES[name])
    if rarely(draw):
        event = dict(draw(st.permutations(list(event.items()))))
    return event


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ts=st.floats(allow_nan=False, width=32) | st.floats(allow_nan=False),
    events=st.lists(typed_events(), max_size=5) | st.lists(typed_events() | map_events, max_size=6),
    rank=st.none() | st.integers(-3, 2**64 - 1),
    with_rank=st.booleans(),
)
def test_read_events_and_msgspec_agree_on_any_batch(
    ts: Any, events: list[Any], rank: Any, with_rank: bool
) -> None:
    payload = msgspec.msgpack.encode([ts, events, rank] if with_rank else [ts, events])
    with pytest.MonkeyPatch.context() as patch:
        original, through_reader, _ = read_both_ways(payload, patch)
    assert through_reader == original


@over_damaged_batches
@given(
    cut=CUTS,
    flips=FLIPS,
)
def test_read_events_on_damaged_batches_agrees_with_msgspec(cut: int, flips: list[tuple[int, int]]) -> None:
    payload = damaged_payload(cut, flips)
    with pytest.MonkeyPatch.context() as patch:
        original, through_reader, _ = read_both_ways(payload, patch)
    assert through_reader == original


def test_random_bytes_never_crash_read_events() -> None:
    reader = require_event_reader()
    rng = random.Random(15)
    for _ in range(3_000):
        data = b"\x93\xcb" + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 80)))
        read = reader(data, BlocksStored, BlocksRemoved, ALL_BLOCKS_CLEARED, TIER_GPU)
        if read is not None:
            with pytest.MonkeyPatch.context() as patch:
                original, through_reader, _ = read_both_ways(data, patch)
            assert through_reader == original


# --- read_events_many: a worker's drain read at once --------------------------------------------------


def read_drain_both_ways(payloads: list[bytes], patch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """msgspec's answer for each payload, and read_default_shapes' (where it reads one; None elsewhere)."""
    require_built(compiled.load_many_event_reader(), "kvindex.indexer._payload", "a C compiler")
    patch.setattr(compiled, "read_events", None)
    patch.setattr(compiled, "without_token_ids", None)
    originals = [decode_or_reason(payload) for payload in payloads]
    patch.setattr(compiled, "read_events_many", compiled.load_many_event_reader())
    return originals, read_default_shapes(payloads)


def test_a_drain_reads_what_msgspec_decodes_payload_by_payload() -> None:
    """Recorded and benchmark batches, one drain well past the size at which the walk drops the GIL, with
    damaged and foreign payloads among them: each is read as msgspec decodes it, or left to it (None)."""
    payloads = recorded_payloads() * 3
    rng = random.Random(64)
    for position in rng.sample(range(len(payloads)), 12):
        damaged = bytearray(payloads[position])
        damaged[rng.randrange(len(damaged))] = rng.getrandbits(8)
        payloads[position] = bytes(damaged[: len(damaged) - rng.randrange(3)])
    payloads[5:5] = [b"", b"\xc0", msgspec.msgpack.encode({"not": "a batch"})]
    assert sum(map(len, payloads)) > 64 * 1024
    with pytest.MonkeyPatch.context() as patch:
        originals, reads = read_drain_both_ways(payloads, patch)
    assert len(reads) == len(payloads)
    assert all(read is None or read == original for read, original in zip(reads, originals, strict=True))
    assert sum(read is not None for read in reads) > len(payloads) // 2
    assert reads[5:8] == [None, None, None]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.tuples(
            st.floats(allow_nan=False),
            st.lists(typed_events(), max_size=4) | st.lists(typed_events() | map_events, max_size=5),
        ),
        max_size=8,
    )
)
def test_a_drain_of_any_batches_agrees_with_msgspec(batches: list[tuple[Any, list[Any]]]) -> None:
    payloads = [msgspec.msgpack.encode([ts, events, 0]) for ts, events in batches]
    with pytest.MonkeyPatch.context() as patch:
        originals, reads = read_drain_both_ways(payloads, patch)
    assert all(read is None or read == original for read, original in zip(reads, originals, strict=True))


def test_without_the_reader_a_drain_is_left_to_msgspec() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "read_events_many", None)
        assert read_default_shapes(recorded_payloads()[:3]) == [None, None, None]


# --- event_span: the hash check's one event ----------------------------------------------------------


def without_then_with(
    patch: pytest.MonkeyPatch, name: str, built: Any, answer: Callable[[], Any]
) -> tuple[Any, Any]:
    """answer() with compiled.`name` unset (decode.py's msgspec path), then with the extension's `built`."""
    patch.setattr(compiled, name, None)
    without = answer()
    patch.setattr(compiled, name, built)
    return without, answer()


def raw_event_both_ways(payload: bytes, pos: int, patch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """raw_event's bytes (or None, or the DecodeError) without the extension, then with it."""
    require_built(compiled.load_event_span(), "kvindex.indexer._payload", "a C compiler")

    def answer() -> Any:
        try:
            raw = raw_event(payload, pos)
        except DecodeError as exc:
            return ("DecodeError", exc.reason)
        return None if raw is None else bytes(raw)

    return without_then_with(patch, "event_span", compiled.load_event_span(), answer)


def test_an_event_s_span_is_the_event_msgspec_splits_out() -> None:
    with pytest.MonkeyPatch.context() as patch:
        for payload in recorded_payloads():
            count = len(msgspec.msgpack.decode(payload)[1])
            for pos in (0, count // 2, count - 1, count, -1):
                without, with_span = raw_event_both_ways(payload, pos, patch)
                assert with_span == without, pos
                assert (without is None) == (not 0 <= pos < count)


@over_damaged_batches
@given(
    cut=CUTS,
    flips=FLIPS,
    pos=st.integers(0, 9),
)
def test_an_event_s_span_in_a_damaged_batch_is_never_another_event(
    cut: int, flips: list[tuple[int, int]], pos: int
) -> None:
    """Where the batch is still readable around the event, the span is msgspec's event; anything else is
    None or msgspec's DecodeError (the check is then skipped), never other bytes."""
    payload = damaged_payload(cut, flips)
    with pytest.MonkeyPatch.context() as patch:
        without, with_span = raw_event_both_ways(payload, pos, patch)
    if isinstance(with_span, bytes) and isinstance(without, bytes):
        assert with_span == without
    elif isinstance(with_span, bytes):
        # msgspec refuses the batch as a whole (damage elsewhere, or a string that is not UTF-8): the
        # event decodes, or fails as the worker expects of any event (it then skips the check).
        try:
            decode_event(with_span)
        except (EventError, ConvertError):
            pass


# --- stored_token_ids: the hash check's token ids of one event ---------------------------------------


def stored_ids_both_ways(
    payload: bytes, pos: int, block_keys: Sequence[int], patch: pytest.MonkeyPatch
) -> tuple[Any, Any]:
    """stored_token_ids' answer (ids as a list, or None) without the compiled reader, then with it."""
    reader = require_built(compiled.load_stored_token_ids(), "kvindex.indexer._payload", "a C compiler")

    def answer() -> Any:
        token_ids = stored_token_ids(payload, pos, block_keys)
        return None if token_ids is None else list(token_ids)

    return without_then_with(patch, "stored_token_ids", reader, answer)


def msgspec_events(payload: bytes) -> list[Any]:
    """Each event of the batch as msgspec's general path decodes it alone (None: it cannot)."""
    events: list[Any] = []
    for raw in raw_events(payload):
        try:
            events.append(decode_event(raw))
        except (EventError, ConvertError):
            events.append(None)
    return events


def test_a_stored_event_s_token_ids_are_the_ones_msgspec_decodes() -> None:
    """Every event of every recorded batch: a BlocksStored's ids, read again with its own keys, are msgspec's
    (as an array('I') from the reader); with other keys, at another kind of event or past the end, None."""
    reader = require_built(compiled.load_stored_token_ids(), "kvindex.indexer._payload", "a C compiler")
    read_by_reader = default_shape_stored = 0
    with pytest.MonkeyPatch.context() as patch:
        for payload in recorded_payloads():
            events = msgspec_events(payload)
            (batch_read,) = read_default_shapes([payload])
            if batch_read is not None:  # the batch reader took it: each of its stored events is readable
                default_shape_stored += sum(isinstance(event, BlocksStored) for event in events)
            for pos, event in enumerate(events):
                if not isinstance(event, BlocksStored):
                    assert stored_ids_both_ways(payload, pos, (), patch) == (None, None), pos
                    continue
                assert stored_ids_both_ways(payload, pos, event.block_keys, patch) == (
                    list(event.token_ids),
                    list(event.token_ids),
                )
                if reader(payload, pos) is not None:
                    read_by_reader += 1
                    ids = stored_token_ids(payload, pos, event.block_keys)
                    assert isinstance(ids, array) and ids.typecode == "I"
                other_keys = (*event.block_keys[:-1], event.block_keys[-1] ^ 1) if event.block_keys else (7,)
                assert stored_ids_both_ways(payload, pos, other_keys, patch) == (None, None)
            assert stored_ids_both_ways(payload, len(events), (), patch) == (None, None)
            assert stored_ids_both_ways(payload, -1, (), patch) == (None, None)
    assert read_by_reader == default_shape_stored > 0


def test_token_ids_beyond_32_bits_are_left_to_msgspec() -> None:
    """The packed form holds uint32 ids: a larger one (or a negative one) makes the reader decline, and
    msgspec's decode gives the ids as they are (the hasher then judges them)."""
    reader = require_built(compiled.load_stored_token_ids(), "kvindex.indexer._payload", "a C compiler")
    for odd_id in (2**32, 2**40 + 3, -1):
        event = BlockStored(
            block_hashes=[11, 12],
            parent_block_hash=None,
            token_ids=[1, odd_id, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        payload = encode_batch(KVEventBatch(ts=1.0, events=[event]))
        assert reader(payload, 0) is None
        with pytest.MonkeyPatch.context() as patch:
            assert stored_ids_both_ways(payload, 0, (11, 12), patch) == ([1, odd_id, 3, 4], [1, odd_id, 3, 4])


@over_damaged_batches
@given(
    cut=CUTS,
    flips=FLIPS,
    pos=st.integers(0, 9),
)
def test_a_damaged_batch_s_token_ids_are_never_another_event_s(
    cut: int, flips: list[tuple[int, int]], pos: int
) -> None:
    """Whatever the damage, ids the reader gives are those msgspec decodes from that event's own bytes, with
    the keys asked for: never another event's, never a crash."""
    reader = require_built(compiled.load_stored_token_ids(), "kvindex.indexer._payload", "a C compiler")
    payload = damaged_payload(cut, flips)
    read = reader(payload, pos)
    if read is None:
        return
    packed_ids, packed_keys = read
    span = compiled.load_event_span()
    assert span is not None
    start_stop = span(payload, pos)
    assert start_stop is not None
    try:
        event = decode_event(payload[start_stop[0] : start_stop[1]])
    except (EventError, ConvertError):
        # A field the check never reads is damaged (a string that is not UTF-8): msgspec refuses the event,
        # the reader does not; the worker only asks about events a decoder read, with their keys.
        return
    assert isinstance(event, BlocksStored)
    assert array("Q", event.block_keys).tobytes() == packed_keys
    assert array("I", event.token_ids).tobytes() == packed_ids
