"""The synthetic ingest + score workload of the indexer benchmark (issue 6), shared by every service.

Feeds the write path of each indexer under test with the same vLLM 0.33 KV-event payloads, and its read
path with the same prompts. Pure and deterministic: the same WorkloadSpec always gives the same events,
payload bytes and queries; no sockets, clocks or global state.

Shape: every engine stores a run of 512-block sequences (8192 tokens): one of `num_prefixes` shared
256-block prefixes followed by 256 blocks unique to that engine; a prefix the engine already holds is not
stored again (vLLM would hit its prefix cache), so its suffix chains onto the cached prefix. Blocks are
announced 16 per BlockStored, 8 BlockStored per message, until the engine has stored `blocks_per_engine`.
"""

from __future__ import annotations

import importlib
import pickle
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from kvindex.hashing import event_hash
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import BlockStored, ExternalBlockHash, KVEventBatch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Token ids stay below a realistic vocabulary and inside u32 (Dynamo decodes token_ids as u32).
_VOCAB_SIZE = 128_000

_KIND_PREFIX = 1
_KIND_SUFFIX = 2
_KIND_FRESH = 3

# (token_ids, block_size, seed) -> raw digests of every full block, chained from token 0.
BlockDigester = Callable[[Sequence[int], int, str], list[bytes]]


@dataclass(frozen=True)
class WorkloadSpec:
    num_engines: int = 20
    blocks_per_engine: int = 2000
    block_size: int = 16
    num_prefixes: int = 10
    prefix_blocks: int = 256
    suffix_blocks: int = 256
    blocks_per_event: int = 16
    events_per_message: int = 8
    num_queries: int = 200
    seed: int = 0
    hash_seed: str = "0"  # PYTHONHASHSEED of the simulated engines (vLLM sha256 root)

    @property
    def query_blocks(self) -> int:
        return self.prefix_blocks + self.suffix_blocks


@dataclass(frozen=True)
class EngineStream:
    """What one engine publishes, in order: `messages[k]` is the event list of batch seq k."""

    engine_index: int
    messages: list[list[BlockStored]]
    stored_event_hashes: frozenset[int]

    @property
    def num_events(self) -> int:
        return sum(len(events) for events in self.messages)

    @property
    def num_blocks(self) -> int:
        return len(self.stored_event_hashes)


@dataclass(frozen=True)
class ScoreQuery:
    """A prompt, its vLLM event hashes, and per engine the leading blocks it holds (0s omitted).

    `expected_blocks` comes from a brute-force walk over each engine's stored hash set, never from an
    indexer under test.
    """

    token_ids: list[int]
    event_hashes: list[int]
    expected_blocks: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    engines: list[EngineStream]
    queries: list[ScoreQuery]

    @property
    def num_events(self) -> int:
        return sum(engine.num_events for engine in self.engines)

    @property
    def num_blocks(self) -> int:
        return sum(engine.num_blocks for engine in self.engines)


# --- hashing -------------------------------------------------------------------------------------


def pickle_sha256_digests(token_ids: Sequence[int], block_size: int, seed: str) -> list[bytes]:
    """vLLM's default `sha256` prefix-cache rule (no extra keys), computed with CPython's own pickle.

    root = sha256(pickle(seed)); h_i = sha256(pickle((h_{i-1} or root, tuple(block_i), None))).
    Pickling the same Python objects vLLM pickles gives the same preimage bytes.
    """
    parent = sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    digests: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = sha256(pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        digests.append(parent)
    return digests


def _project_block_hasher() -> Any | None:
    # Looked up by name: kvindex.hashing.BlockHasher is being built in parallel and may not exist yet.
    return getattr(importlib.import_module("kvindex.hashing"), "BlockHasher", None)


def kvindex_digests(token_ids: Sequence[int], block_size: int, seed: str) -> list[bytes]:
    """The same rule through the project's own hasher (kvindex.hashing.BlockHasher)."""
    hasher_class = _project_block_hasher()
    if hasher_class is None:
        raise RuntimeError("kvindex.hashing.BlockHasher is not available yet")
    hasher = hasher_class(algo="sha256", block_size=block_size, seed=seed)
    return [bytes(digest) for digest in hasher.block_hashes(list(token_ids))]


# --- token content -------------------------------------------------------------------------------


def _splitmix64(value: int) -> int:
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def block_tokens(seed: int, kind: int, owner: int, block_index: int, block_size: int) -> list[int]:
    """Deterministic, cheap token ids of one block; distinct (kind, owner, index) give distinct blocks."""
    base = _splitmix64(_splitmix64(_splitmix64(seed ^ (kind << 60)) ^ owner) ^ block_index)
    return [((base + j * _GOLDEN) & _MASK64) % _VOCAB_SIZE for j in range(block_size)]


def _run_tokens(spec: WorkloadSpec, kind: int, owner: int, num_blocks: int) -> list[int]:
    token_ids: list[int] = []
    for block_index in range(num_blocks):
        token_ids.extend(block_tokens(spec.seed, kind, owner, block_index, spec.block_size))
    return token_ids


# --- building ------------------------------------------------------------------------------------


def _block_stored(
    spec: WorkloadSpec, hashes: list[int], parent: int | None, token_ids: list[int]
) -> BlockStored:
    # The fields vLLM 0.33's BlockPool + KVCacheManager set for a plain full-attention request.
    return BlockStored(
        block_hashes=list[ExternalBlockHash](hashes),
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=spec.block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def _suffix_owner(engine_index: int, sequence_index: int) -> int:
    return engine_index * 1_000_003 + sequence_index


def _engine_stream(
    spec: WorkloadSpec,
    engine_index: int,
    prefix_tokens: list[list[int]],
    digester: BlockDigester,
) -> tuple[EngineStream, list[tuple[int, int]]]:
    """One engine's events; also the (prefix_id, sequence_index) of every sequence it stored."""
    rng = random.Random(spec.seed * 7919 + engine_index)
    events: list[BlockStored] = []
    stored: set[int] = set()
    held_prefixes: set[int] = set()
    sequences: list[tuple[int, int]] = []
    budget = spec.blocks_per_engine
    sequence_index = 0
    while budget > 0:
        prefix_id = rng.randrange(spec.num_prefixes)
        suffix = _run_tokens(
            spec, _KIND_SUFFIX, _suffix_owner(engine_index, sequence_index), spec.suffix_blocks
        )
        token_ids = prefix_tokens[prefix_id] + suffix
        hashes = [event_hash(d) for d in digester(token_ids, spec.block_size, spec.hash_seed)]
        first_new = spec.prefix_blocks if prefix_id in held_prefixes else 0
        last_new = min(len(hashes), first_new + budget)
        for start in range(first_new, last_new, spec.blocks_per_event):
            end = min(start + spec.blocks_per_event, last_new)
            parent = hashes[start - 1] if start > 0 else None
            span = token_ids[start * spec.block_size : end * spec.block_size]
            events.append(_block_stored(spec, hashes[start:end], parent, span))
        stored.update(hashes[first_new:last_new])
        budget -= last_new - first_new
        held_prefixes.add(prefix_id)
        sequences.append((prefix_id, sequence_index))
        sequence_index += 1
    per_message = spec.events_per_message
    messages = [events[i : i + per_message] for i in range(0, len(events), per_message)]
    return EngineStream(engine_index, messages, frozenset(stored)), sequences


def _leading_blocks(event_hashes: list[int], stored: frozenset[int]) -> int:
    matched = 0
    for block_hash in event_hashes:
        if block_hash not in stored:
            break
        matched += 1
    return matched


def _queries(
    spec: WorkloadSpec,
    engines: list[EngineStream],
    sequences: list[list[tuple[int, int]]],
    prefix_tokens: list[list[int]],
    digester: BlockDigester,
) -> list[ScoreQuery]:
    """Prompts of `query_blocks` blocks: a stored prefix, part of one engine's suffix, then new blocks."""
    rng = random.Random(spec.seed * 104_729 + 1)
    queries: list[ScoreQuery] = []
    for query_index in range(spec.num_queries):
        engine_index = rng.randrange(len(engines))
        prefix_id, sequence_index = rng.choice(sequences[engine_index])
        shared_suffix_blocks = rng.randrange(spec.suffix_blocks + 1)
        suffix = _run_tokens(
            spec, _KIND_SUFFIX, _suffix_owner(engine_index, sequence_index), shared_suffix_blocks
        )
        fresh = _run_tokens(spec, _KIND_FRESH, query_index, spec.suffix_blocks - shared_suffix_blocks)
        token_ids = prefix_tokens[prefix_id] + suffix + fresh
        hashes = [event_hash(d) for d in digester(token_ids, spec.block_size, spec.hash_seed)]
        expected = {
            engine.engine_index: matched
            for engine in engines
            if (matched := _leading_blocks(hashes, engine.stored_event_hashes)) > 0
        }
        queries.append(ScoreQuery(token_ids, hashes, expected))
    return queries


def default_digester() -> BlockDigester:
    """kvindex's own hasher when it has landed, else the pickle rule (both are vLLM's sha256)."""
    return pickle_sha256_digests if _project_block_hasher() is None else kvindex_digests


def build_workload(spec: WorkloadSpec, digester: BlockDigester | None = None) -> Workload:
    """Every engine's messages and the score queries for `spec` (deterministic)."""
    if spec.num_engines < 1 or spec.blocks_per_engine < 1 or spec.num_prefixes < 1:
        raise ValueError("num_engines, blocks_per_engine and num_prefixes must be at least 1")
    digest_fn = digester if digester is not None else default_digester()
    prefix_tokens = [
        _run_tokens(spec, _KIND_PREFIX, prefix_id, spec.prefix_blocks)
        for prefix_id in range(spec.num_prefixes)
    ]
    engines: list[EngineStream] = []
    sequences: list[list[tuple[int, int]]] = []
    for engine_index in range(spec.num_engines):
        engine, engine_sequences = _engine_stream(spec, engine_index, prefix_tokens, digest_fn)
        engines.append(engine)
        sequences.append(engine_sequences)
    return Workload(spec, engines, _queries(spec, engines, sequences, prefix_tokens, digest_fn))


def build_payloads(
    spec: WorkloadSpec, digester: BlockDigester | None = None
) -> tuple[list[list[bytes]], int, int]:
    """(every engine's encoded payloads, number of events, number of blocks) — the bytes
    `encode_engine(build_workload(spec).engines[i])` gives, but one engine at a time, keeping neither event
    objects nor queries: for runs (10M pairs) too big to hold as Python objects."""
    if spec.num_engines < 1 or spec.blocks_per_engine < 1 or spec.num_prefixes < 1:
        raise ValueError("num_engines, blocks_per_engine and num_prefixes must be at least 1")
    digest_fn = digester if digester is not None else default_digester()
    prefix_tokens = [
        _run_tokens(spec, _KIND_PREFIX, prefix_id, spec.prefix_blocks)
        for prefix_id in range(spec.num_prefixes)
    ]
    payloads: list[list[bytes]] = []
    num_events = num_blocks = 0
    for engine_index in range(spec.num_engines):
        engine, _ = _engine_stream(spec, engine_index, prefix_tokens, digest_fn)
        payloads.append(encode_engine(engine))
        num_events += engine.num_events
        num_blocks += engine.num_blocks
    return payloads, num_events, num_blocks


def encode_message(events: Sequence[BlockStored], *, ts: float = 0.0, dp_rank: int = 0) -> bytes:
    """The msgpack payload vLLM 0.33 sends for one batch (map-form events in a 3-element array).

    Dynamo 1.6.1's decoder accepts this shape as is (checked against the real binary), so every
    service under test is fed the same bytes.
    """
    payload: bytes = encode_batch(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=dp_rank))
    return payload


def encode_engine(engine: EngineStream, *, dp_rank: int = 0) -> list[bytes]:
    """All payloads of one engine, ready to send as frame 2 with seq = list index."""
    return [
        encode_message(events, ts=float(seq), dp_rank=dp_rank) for seq, events in enumerate(engine.messages)
    ]
