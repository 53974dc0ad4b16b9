"""kvindex's own KV-cache events: what the index applies.

Wire objects (replay/wire.py) are converted into these once, in indexer/convert.py; the index never sees a
wire object. Block hashes are always the 64-bit event form (`BlockKey`): raw-bytes hashes on the wire are
folded to the same form by kvindex.hashing.event_hash (last 8 bytes, big-endian), exactly as vLLM does for
its int hashes.
"""

from __future__ import annotations

from typing import NewType

import msgspec

# The 64-bit form of a block hash as vLLM publishes it (unsigned, last 8 bytes big-endian of the digest).
BlockKey = NewType("BlockKey", int)
# A pod as the operator names it (connect-mode `--pod ID=...`, or the `kv@<pod>@<model>` topic).
PodId = NewType("PodId", str)

TIER_GPU = "GPU"
TIER_CPU = "CPU"
TIER_STORAGE = "STORAGE"

# KV-cache group kinds whose blocks form a reusable prefix; anything else (sliding window, mamba, ...)
# is kept out of prefix scoring.
PREFIX_SPEC_KINDS = frozenset({"full_attention", "mla_attention"})


class PodRef(msgspec.Struct, frozen=True, order=True):
    """One event stream: a pod and its data-parallel rank (each rank has its own publisher and seq)."""

    pod_id: str
    dp_rank: int = 0


# NOTE: events are never tracked by the cyclic GC (gc=False): they hold only tuples of immutable values,
# so they cannot be part of a cycle, and ingest makes millions of them (each tracked allocation brings
# the next collection closer).


class BlocksStored(msgspec.Struct, frozen=True, gc=False):
    """Blocks newly held by a pod on `tier`; `block_keys` are in prompt order."""

    block_keys: tuple[int, ...]
    parent_key: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str = TIER_GPU
    lora_name: str | None = None
    # One entry per block key: vLLM's untagged extra keys (None for a plain block).
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    locality: str | None = None
    # Per block, the lookahead tokens hashed into it (speculative drafters).
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class BlocksRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks a pod no longer holds on `tier` (other tiers keep theirs)."""

    block_keys: tuple[int, ...]
    tier: str = TIER_GPU
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The pod dropped every block (vLLM's reset_prefix_cache)."""


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One decoded vLLM batch: the events of one engine step, in order."""

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None
