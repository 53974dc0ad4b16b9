"""The one seam between vLLM's wire events (replay/wire.py) and kvindex's own (indexer/events.py).

Write path: frames -> wire decode -> **convert** -> per-pod queue -> index apply. Pure: values in, values
out. Hashes become 64-bit keys (raw digests folded like vLLM's int hashes), the medium becomes the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import msgspec
from kvindex.hashing import event_hash
from kvindex.indexer.events import TIER_GPU, AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from kvindex.replay import wire

# Reinterprets a signed 64-bit int as unsigned (two's complement); not the digest fold, which is event_hash.
_U64_MASK = 2**64 - 1
_I64_MIN = -(2**63)
_MIN_DIGEST_BYTES = 8
_ALL_BLOCKS_CLEARED = AllBlocksCleared()

WireBlockStored = (
    wire.BlockStored | wire.LooseBlockStored | wire.ArrayBlockStored | wire.BlockStoredTokensSkipped
)
WireBlockRemoved = wire.BlockRemoved | wire.LooseBlockRemoved | wire.ArrayBlockRemoved


class ConvertError(ValueError):
    """A wire event that decoded but carries a value kvindex cannot use; `reason` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def block_key(block_hash: wire.ExternalBlockHash) -> int:
    """The 64-bit key of one wire hash: ints as they are, raw digests folded like vLLM's int form.

    A negative int is read as a signed 64-bit value (a producer using int64) and folded to unsigned.
    """
    if type(block_hash) is int:
        if block_hash >= 0:
            return block_hash
        if block_hash >= _I64_MIN:
            return block_hash & _U64_MASK
        raise ConvertError("bad_hash", f"hash {block_hash} is below the signed 64-bit range")
    if isinstance(block_hash, bytes):
        if len(block_hash) < _MIN_DIGEST_BYTES:
            raise ConvertError("bad_hash", f"digest of {len(block_hash)} bytes is shorter than 8")
        return event_hash(block_hash)
    raise ConvertError("bad_hash", f"hash of type {type(block_hash).__name__}")


def block_keys(block_hashes: Sequence[wire.ExternalBlockHash]) -> tuple[int, ...]:
    """Keys of a hash list in order. Fast when every hash is a non-negative int (vLLM's default)."""
    keys = tuple(block_hashes)
    try:
        # One C-level pass: min() of all ints is an int; bytes give bytes; a mix raises TypeError.
        lowest = min(keys) if keys else 0
    except TypeError:
        lowest = None
    if type(lowest) is int and lowest >= 0:
        return cast(tuple[int, ...], keys)
    return tuple(block_key(h) for h in keys)


# NOTE: vLLM's extra keys are shallow (per block: LoRA name, (mm identifier, offset), salt, digest); a
# few hundred levels of nesting (a few hundred bytes on the wire) would exhaust Python's recursion limit
# below, so deeper values are refused as the event's fault.
MAX_EXTRA_KEYS_DEPTH = 32


def _freeze(value: Any, depth: int = 0) -> Any:
    """Lists (msgpack arrays) to tuples, recursively, so extra keys are hashable."""
    if isinstance(value, list):
        if depth >= MAX_EXTRA_KEYS_DEPTH:
            raise ConvertError("too_deep", f"extra keys nested deeper than {MAX_EXTRA_KEYS_DEPTH} levels")
        return tuple(_freeze(item, depth + 1) for item in value)
    return value


def convert_extra_keys(extra_keys: list[Any] | None) -> tuple[object, ...] | None:
    """vLLM's per-block extra keys, hashable; a plain request's `[nil, ...]` stays all None.

    Raises ConvertError("too_deep") for entries nested deeper than MAX_EXTRA_KEYS_DEPTH."""
    if extra_keys is None:
        return None
    if not any(extra_keys):
        # A plain request publishes [nil, ...]; an empty entry means the same thing.
        return (None,) * len(extra_keys)
    return tuple(_freeze(entry) if entry else None for entry in extra_keys)


def stored_event(
    keys: tuple[int, ...],
    parent_key: int | None,
    token_ids: tuple[int, ...],
    block_size: int,
    medium: str | None,
    lora_name: str | None,
    extra_keys: list[Any] | None,
    group_idx: int | None,
    spec_kind: str | None,
    locality: str | None,
    lookahead_token_ids: list[list[int]] | None,
) -> BlocksStored:
    """The one construction of a BlocksStored from wire fields, once hashes are keys: the medium becomes
    the tier (GPU when unset), extra keys and lookahead tokens become hashable tuples. Shared by
    `convert_stored` and decode's hot path (which checks keys in msgspec), so both build the same event; the
    compiled batch reader (indexer/_payload.c, read_events) builds the same positional call in C, and
    tests/indexer/test_payload.py holds the two equal."""
    # Positional (faster than keywords on the hot path), in BlocksStored's field order.
    return BlocksStored(
        keys,
        parent_key,
        token_ids,
        block_size,
        medium or TIER_GPU,
        lora_name,
        convert_extra_keys(extra_keys),
        group_idx,
        spec_kind,
        locality,
        None if lookahead_token_ids is None else tuple(tuple(tokens) for tokens in lookahead_token_ids),
    )


def removed_event(keys: tuple[int, ...], medium: str | None, group_idx: int | None) -> BlocksRemoved:
    """The one construction of a BlocksRemoved from wire fields, once hashes are keys."""
    return BlocksRemoved(keys, medium or TIER_GPU, group_idx)


def convert_stored(event: WireBlockStored) -> BlocksStored:
    """A stored event; when its token ids were skipped at decode time (`msgspec.Raw`) they become ()."""
    parent = event.parent_block_hash
    token_ids = event.token_ids
    return stored_event(
        block_keys(event.block_hashes),
        None if parent is None else block_key(parent),
        () if type(token_ids) is msgspec.Raw else tuple(token_ids),
        event.block_size,
        event.medium,
        event.lora_name,
        event.extra_keys,
        event.group_idx,
        event.kv_cache_spec_kind,
        event.locality,
        event.lookahead_token_ids,
    )


def convert_removed(event: WireBlockRemoved) -> BlocksRemoved:
    return removed_event(block_keys(event.block_hashes), event.medium, event.group_idx)


def convert_event(event: wire.AnyWireEvent) -> KVEvent:
    """One wire event (any accepted shape) -> kvindex's event; raises ConvertError on unusable values."""
    if isinstance(
        event, (wire.BlockStored, wire.LooseBlockStored, wire.ArrayBlockStored)
    ):  # incl. subclasses
        return convert_stored(event)
    if isinstance(event, (wire.BlockRemoved, wire.LooseBlockRemoved, wire.ArrayBlockRemoved)):
        return convert_removed(event)
    return _ALL_BLOCKS_CLEARED
