"""vLLM's KV-event wire types (vLLM 0.33.0, vllm/distributed/kv_events.py), mirrored field for field.

These are what travels in the msgpack payload of a live or replayed message. They are used to *encode*
(our publisher must be byte-identical to vLLM's) and as the fast path to decode; replay/decode.py adds
tolerance for older shapes. Field order and defaults are part of the wire format: evolve only by
appending fields with defaults, as vLLM does.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM publishes hashes as unsigned 64-bit ints by default, raw digest bytes when
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"


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
