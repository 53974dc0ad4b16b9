"""vLLM's KV-event wire types (vLLM 0.33.0, vllm/distributed/kv_events.py), mirrored field for field.

These are what travels in the msgpack payload of a live or replayed message. They are used to *encode*
(our publisher must be byte-identical to vLLM's) and as the fast path to decode. The `Loose*` and
`Array*` variants at the end mirror older and partial shapes for indexer/decode.py's per-event fallback.
Field order and defaults are part of the wire format: evolve only by appending fields with defaults, as
vLLM does.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM publishes hashes as unsigned 64-bit ints by default, raw digest bytes when
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps: `{"type": <class name>, ...}`."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Any: msgspec passes each entry (nil or an array of msgpack values) through unchecked; convert freezes it.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """`[ts, events, data_parallel_rank]`: the rank is always encoded, nil when unset."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


# --- tolerant shapes, used only to decode (never to encode) -------------------------------------------
# Older vLLM (e.g. b4e69e0a) sent events as arrays `[tag, block_hashes, parent, token_ids, block_size,
# lora_id]` / `[tag, block_hashes]`; later releases appended fields in the order of the 0.33 maps. Every
# field after block_hashes has a default so both shorter arrays and maps missing fields decode; msgspec
# ignores trailing array elements and unknown map keys, so newer shapes decode too.


class _BlockStoredFields(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _BlockRemovedFields(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class LooseBlockStored(_BlockStoredFields, frozen=True, tag="BlockStored"):
    """A BlockStored map missing fields that 0.33 always writes."""


class LooseBlockRemoved(_BlockRemovedFields, frozen=True, tag="BlockRemoved"):
    """A BlockRemoved map missing fields that 0.33 always writes."""


class LooseAllBlocksCleared(msgspec.Struct, frozen=True, gc=False, tag="AllBlocksCleared"):
    pass


class ArrayBlockStored(_BlockStoredFields, frozen=True, array_like=True, tag="BlockStored"):
    """`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]`."""


class ArrayBlockRemoved(_BlockRemovedFields, frozen=True, array_like=True, tag="BlockRemoved"):
    """`["BlockRemoved", block_hashes, medium, ...]`."""


class ArrayAllBlocksCleared(msgspec.Struct, frozen=True, gc=False, array_like=True, tag="AllBlocksCleared"):
    """`["AllBlocksCleared"]`."""


LooseWireEvent = LooseBlockStored | LooseBlockRemoved | LooseAllBlocksCleared
ArrayWireEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
AnyWireEvent = WireEvent | LooseWireEvent | ArrayWireEvent
EVENT_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class BlockStoredTokensSkipped(BlockStored, frozen=True, tag="BlockStored"):
    """BlockStored for consumers that do not need token ids: they stay undecoded (most of the bytes)."""

    # Decode-only: the field keeps its place and name on the wire, msgspec just leaves its bytes undecoded.
    token_ids: msgspec.Raw  # type: ignore[assignment]


class KVEventBatchTokensSkipped(KVEventBatch, frozen=True):
    # Decode-only, so list invariance does not bite: nothing writes a WireEvent into this list.
    events: list[BlockStoredTokensSkipped | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class RawArrayBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A batch whose events are decoded one at a time: `[ts, events]` or `[ts, events, rank]`."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class RawMapBatch(msgspec.Struct, frozen=True, gc=False):
    """The same as a map, for releases whose EventBatch was not array_like."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
