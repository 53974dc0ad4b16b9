"""Stage 3 of the write path: a batch payload (msgpack) -> kvindex's EventBatch. Pure, no sockets.

Fast path: the whole batch through one typed decoder of vLLM 0.33's exact shape. When that fails, the
batch is split into raw events and each is decoded on its own, accepting older and partial shapes; an
event that still cannot be read is dropped and counted by reason, and the rest of the batch survives.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from kvindex.indexer import compiled
from kvindex.indexer.convert import ConvertError, convert_event, removed_event, stored_event
from kvindex.indexer.events import (
    TIER_GPU,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    KVEvent,
)
from kvindex.replay import wire

# --- the ingest hot path: vLLM's default shape, decoded straight into what the index needs -----------
# Same fields and required-ness as wire.BlockStored / BlockRemoved, but hashes must be unsigned 64-bit
# ints (vLLM's default), checked and made tuples by msgspec in C, and token ids stay undecoded. Anything
# else (raw-digest hashes, signed ints, odd shapes) fails here and takes the general path below.
_Key = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1


class _HotStored(msgspec.Struct, frozen=True, gc=False, tag="BlockStored"):
    block_hashes: tuple[_Key, ...]
    parent_block_hash: _Key | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _HotRemoved(msgspec.Struct, frozen=True, gc=False, tag="BlockRemoved"):
    block_hashes: tuple[_Key, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _HotCleared(msgspec.Struct, frozen=True, gc=False, tag="AllBlocksCleared"):
    pass


class _HotBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    ts: float
    events: list[_HotStored | _HotRemoved | _HotCleared]
    data_parallel_rank: int | None = None


_HOT_DECODER = msgspec.msgpack.Decoder(_HotBatch)
_ALL_BLOCKS_CLEARED = AllBlocksCleared()
_NO_DROPS: dict[str, int] = {}

# Built once: msgspec decoders are immutable and reusable.
_BATCH_DECODER = msgspec.msgpack.Decoder(wire.KVEventBatch)
_BATCH_DECODER_TOKENS_SKIPPED = msgspec.msgpack.Decoder(wire.KVEventBatchTokensSkipped)
_RAW_ARRAY_BATCH_DECODER = msgspec.msgpack.Decoder(wire.RawArrayBatch)
_RAW_MAP_BATCH_DECODER = msgspec.msgpack.Decoder(wire.RawMapBatch)
_LOOSE_EVENT_DECODER = msgspec.msgpack.Decoder(wire.LooseWireEvent)
_ARRAY_EVENT_DECODER = msgspec.msgpack.Decoder(wire.ArrayWireEvent)
_ANY_DECODER = msgspec.msgpack.Decoder()

# Reasons, as metric labels.
REASON_NOT_MSGPACK = "not_msgpack"  # batch: not one complete msgpack value
REASON_BAD_BATCH = "bad_batch"  # batch: valid msgpack, but not [ts, [events...], rank?]
REASON_UNKNOWN_EVENT = "unknown_event_type"  # event: a tag this version does not know
REASON_MALFORMED_EVENT = "malformed_event"  # event: known tag, fields of the wrong shape
REASON_BAD_HASH = "bad_hash"  # event: a hash that is not a 64-bit int or a digest
# batch or event: nested deeper than msgspec's recursion limit (~1,000 levels in a few KB), which raises
# RecursionError rather than a msgspec error. vLLM's own nesting is a few levels.
REASON_TOO_DEEP = "too_deep"

# stored_token_ids' packed forms: the hash core's packed ids (uint32), and the events' keys (uint64).
_ID_TYPECODE = "I"
_KEY_TYPECODE = "Q"
_MAP_MARKERS = frozenset({0xDE, 0xDF, *range(0x80, 0x90)})
_ARRAY_MARKERS = frozenset({0xDC, 0xDD, *range(0x90, 0xA0)})


class DecodeError(ValueError):
    """The batch itself is unreadable (nothing in it can be trusted); `reason` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class DecodedBatch(msgspec.Struct, frozen=True):
    """A decoded batch and what was dropped from it (reason -> number of events)."""

    batch: EventBatch
    dropped: dict[str, int]

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())


def decode_batch(payload: bytes, *, with_token_ids: bool = True) -> DecodedBatch:
    """Decode one KV-event batch payload, keeping every readable event in order.

    Raises DecodeError only when the batch as a whole cannot be read; a bad or unknown event is dropped
    and counted in `dropped`. With `with_token_ids=False` the fast path leaves token ids undecoded (they
    are most of a batch's bytes) and BlocksStored.token_ids is () — for consumers that never use them.
    """
    if not with_token_ids:
        # The compiled reader builds the events of vLLM's default shape itself (indexer/_payload.c)...
        read = _read_default_shape(payload)
        if read is not None:
            return read
        # ... else it copies the batch without its token ids, off the GIL (indexer/_payload.c):
        # the same events, a fraction of the bytes for msgspec to walk.
        slim = compiled.without_token_ids(payload) if compiled.without_token_ids is not None else None
        try:
            return _decode_hot(_HOT_DECODER.decode(payload if slim is None else slim))
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, ConvertError):
            pass  # not the default shape: the general path below says what is wrong, event by event
    decoder = _BATCH_DECODER if with_token_ids else _BATCH_DECODER_TOKENS_SKIPPED
    try:
        wire_batch = decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return _decode_event_by_event(payload)
    events: list[KVEvent] = []
    dropped: dict[str, int] = {}
    for wire_event in wire_batch.events:
        try:
            events.append(convert_event(wire_event))
        except ConvertError as exc:
            dropped[exc.reason] = dropped.get(exc.reason, 0) + 1
    batch = EventBatch(ts=wire_batch.ts, events=tuple(events), dp_rank=wire_batch.data_parallel_rank)
    return DecodedBatch(batch=batch, dropped=dropped)


def read_default_shapes(payloads: list[bytes]) -> list[DecodedBatch | None]:
    """What `decode_batch(payload, with_token_ids=False)` gives for each payload of vLLM's default shape,
    else None (decode that one with decode_batch). With the compiled reader the payloads' bytes are walked
    in one stretch without the GIL (a worker's drain); without it, every answer is None."""
    read_events_many = compiled.read_events_many
    if read_events_many is None:
        return [None] * len(payloads)
    reads = read_events_many(payloads, BlocksStored, BlocksRemoved, _ALL_BLOCKS_CLEARED, TIER_GPU)
    return [_read_batch(read) for read in reads]


def _read_default_shape(payload: bytes) -> DecodedBatch | None:
    read_events = compiled.read_events
    if read_events is None:
        return None
    return _read_batch(read_events(payload, BlocksStored, BlocksRemoved, _ALL_BLOCKS_CLEARED, TIER_GPU))


def _read_batch(read: tuple[float, tuple[KVEvent, ...], int | None] | None) -> DecodedBatch | None:
    """The compiled reader's (ts, events, rank) as a DecodedBatch (None: it declined the payload)."""
    if read is None:
        return None
    ts, events, dp_rank = read
    return DecodedBatch(batch=EventBatch(ts=ts, events=events, dp_rank=dp_rank), dropped=_NO_DROPS)


def _decode_hot(hot: _HotBatch) -> DecodedBatch:
    events: list[KVEvent] = []
    append = events.append
    for event in hot.events:
        if type(event) is _HotStored:
            # Keys were checked by msgspec; convert.py builds the event (one wire -> domain seam).
            append(
                stored_event(
                    event.block_hashes,
                    event.parent_block_hash,
                    (),
                    event.block_size,
                    event.medium,
                    event.lora_name,
                    event.extra_keys,
                    event.group_idx,
                    event.kv_cache_spec_kind,
                    event.locality,
                    event.lookahead_token_ids,
                )
            )
        elif type(event) is _HotRemoved:
            append(removed_event(event.block_hashes, event.medium, event.group_idx))
        else:
            append(_ALL_BLOCKS_CLEARED)
    batch = EventBatch(ts=hot.ts, events=tuple(events), dp_rank=hot.data_parallel_rank)
    # A shared empty dict: nothing was dropped (callers only read it).
    return DecodedBatch(batch=batch, dropped=_NO_DROPS)


def _decode_raw_batch(payload: bytes) -> wire.RawArrayBatch | wire.RawMapBatch:
    # NOTE: msgspec.ValidationError subclasses msgspec.DecodeError, so it is caught first.
    try:
        return _RAW_ARRAY_BATCH_DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        array_error = str(exc)
    except msgspec.DecodeError as exc:
        raise DecodeError(REASON_NOT_MSGPACK, str(exc)) from None
    except RecursionError:
        raise DecodeError(REASON_TOO_DEEP, "nested deeper than the decoder's recursion limit") from None
    try:
        return _RAW_MAP_BATCH_DECODER.decode(payload)
    except msgspec.DecodeError:
        raise DecodeError(REASON_BAD_BATCH, array_error) from None
    except RecursionError:
        raise DecodeError(REASON_TOO_DEEP, "nested deeper than the decoder's recursion limit") from None


def raw_event(payload: bytes, pos: int) -> msgspec.Raw | None:
    """Event `pos` of a batch left undecoded (to read it again in full with `decode_event`), or None when
    the batch has no such event. With the compiled reader only the bytes before it are walked; without
    it the batch is split into raw events. Raises DecodeError when the batch itself is unreadable."""
    event_span = compiled.event_span
    span = None if event_span is None else event_span(payload, pos)
    if span is not None:
        return msgspec.Raw(memoryview(payload)[span[0] : span[1]])
    events = raw_events(payload)
    return events[pos] if 0 <= pos < len(events) else None


def stored_token_ids(payload: bytes, pos: int, block_keys: Sequence[int]) -> Sequence[int] | None:
    """The token ids of event `pos` of a batch, read again from its bytes (the hot path skipped them), if that
    event is a BlocksStored of these block keys; None if it is not (the batch was read around a dropped
    event) or cannot be read. The compiled reader gives them as an array('I'), which the hash core takes
    without an int object per id; otherwise the event is decoded in full with msgspec."""
    read_ids = compiled.stored_token_ids
    read = None if read_ids is None else read_ids(payload, pos)
    if read is not None:
        packed_ids, packed_keys = read
        if packed_keys != array(_KEY_TYPECODE, block_keys).tobytes():
            return None
        token_ids = array(_ID_TYPECODE)
        token_ids.frombytes(packed_ids)
        return token_ids
    try:
        raw = raw_event(payload, pos)
        event = None if raw is None else decode_event(raw)
    except (DecodeError, EventError, ConvertError):
        return None
    if not isinstance(event, BlocksStored) or event.block_keys != tuple(block_keys):
        return None
    return event.token_ids


def raw_events(payload: bytes) -> list[msgspec.Raw]:
    """A batch's events left undecoded, in order (to read one of them again in full with
    `decode_event`); raises DecodeError when the batch itself is unreadable."""
    return _decode_raw_batch(payload).events


def _decode_event_by_event(payload: bytes) -> DecodedBatch:
    raw_batch = _decode_raw_batch(payload)
    events: list[KVEvent] = []
    dropped: dict[str, int] = {}
    for raw_event in raw_batch.events:
        try:
            events.append(decode_event(raw_event))
        except (ConvertError, EventError) as exc:
            dropped[exc.reason] = dropped.get(exc.reason, 0) + 1
    batch = EventBatch(ts=raw_batch.ts, events=tuple(events), dp_rank=raw_batch.data_parallel_rank)
    return DecodedBatch(batch=batch, dropped=dropped)


class EventError(ValueError):
    """One event that cannot be read; the batch around it is fine."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode_event(raw_event: msgspec.Raw | bytes) -> KVEvent:
    """Decode one event in any accepted shape (0.33 map, partial map, array of any length).

    Raises EventError (unknown tag, wrong field shapes) or ConvertError (unusable hash).
    """
    raw = bytes(raw_event)
    marker = raw[0] if raw else -1
    decoder = (
        _LOOSE_EVENT_DECODER
        if marker in _MAP_MARKERS
        else _ARRAY_EVENT_DECODER
        if marker in _ARRAY_MARKERS
        else None
    )
    if decoder is None:
        raise EventError(REASON_MALFORMED_EVENT, "event is neither a map nor an array")
    try:
        wire_event = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise EventError(_classify(raw), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise EventError(REASON_MALFORMED_EVENT, str(exc)) from None
    except RecursionError:
        raise EventError(REASON_TOO_DEEP, "nested deeper than the decoder's recursion limit") from None
    return convert_event(wire_event)


def _classify(raw: bytes) -> str:
    """Why an event failed to decode: a tag we do not know, or a known tag with bad fields."""
    try:
        value = _ANY_DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return REASON_MALFORMED_EVENT
    if isinstance(value, dict):
        tag = value.get("type")
    elif isinstance(value, list) and value:
        tag = value[0]
    else:
        tag = None
    return REASON_MALFORMED_EVENT if isinstance(tag, str) and tag in wire.EVENT_TAGS else REASON_UNKNOWN_EVENT
