"""SimPrefixCache against vLLM's own BlockPool output (vectors) and a brute-force reference model.

The reference model below is written from vLLM's rules (block_pool.py / kv_cache_manager.py), with a
different representation (plain lists, linear scans) so that a shared bug is unlikely.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, WireEvent
from kvindex.sim.cache import (
    CapacityError,
    SimPrefixCache,
    event_hash,
    synthetic_output_tokens,
)

VECTORS = Path(__file__).resolve().parent.parent / "vectors"


def chained_digests(token_ids: list[int], block_size: int) -> list[bytes]:
    """A stand-in block hash (chained over the prefix, like vLLM's) that owes nothing to kvindex.hashing."""
    digests: list[bytes] = []
    parent = b"root"
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(tuple(token_ids[start : start + block_size])).encode()).digest()
        digests.append(parent)
    return digests


# --- vLLM's own BlockPool events -------------------------------------------------------------------


def _plain_blockpool_case() -> tuple[list[int], list[dict[str, object]]]:
    raw = json.loads((VECTORS / "vllm-0.33.0-raw-vectors.json").read_text())
    (case,) = [c for c in raw["blockpool_event_cases"] if c["algo"] == "sha256" and c["case"] == "plain"]
    return raw["prompts"]["48"], case["steps"]


def _digest_for(event_int: int) -> bytes:
    # The cache only keys on the digest and publishes its last 8 bytes: this digest publishes `event_int`.
    return bytes(24) + event_int.to_bytes(8, "big")


def _builtins_without_spec_kind(event: WireEvent) -> dict[str, object]:
    # vLLM's raw BlockPool events lack kv_cache_spec_kind: only KVCacheManager.take_events adds it.
    as_dict = msgspec.to_builtins(event)
    assert isinstance(as_dict, dict)
    as_dict.pop("kv_cache_spec_kind", None)
    return as_dict


def test_store_evict_reset_events_equal_vllm_blockpool() -> None:
    prompt_48, steps = _plain_blockpool_case()
    stored_step0 = steps[0]["events_builtins"]
    stored_step1 = steps[1]["events_builtins"]
    evicted_step = steps[3]
    reset_step = steps[4]
    hashes = stored_step0[0]["block_hashes"] + stored_step1[0]["block_hashes"]
    digests = [_digest_for(h) for h in hashes]
    # vLLM's pool had 8 blocks, one of them its null block.
    cache = SimPrefixCache(capacity_blocks=7, block_size=16)

    first = cache.run("a", prompt_48[:17], digests[:1])
    assert first.num_cached_tokens == 0
    assert [_builtins_without_spec_kind(e) for e in first.events] == stored_step0
    assert first.events[0].kv_cache_spec_kind == "full_attention"  # type: ignore[union-attr]

    # 49 tokens: block 0 hits, blocks 1-2 are newly cached with block 0 as parent.
    second = cache.run("b", prompt_48 + [7], digests)
    assert second.num_cached_tokens == 16
    assert [_builtins_without_spec_kind(e) for e in second.events] == stored_step1

    # A request taking every block evicts the prompt tail first (reverse-order free), as vLLM did.
    fresh_tokens = [100_000 + i for i in range(7 * 16)]
    third = cache.run("c", fresh_tokens, chained_digests(fresh_tokens, 16))
    removed = [e for e in third.events if isinstance(e, BlockRemoved)]
    assert [msgspec.to_builtins(e) for e in removed] == evicted_step["events_builtins"]
    batch = KVEventBatch(ts=1700000000.25, events=list(removed), data_parallel_rank=0)
    assert encode_batch(batch).hex() == evicted_step["batch_payload_hex"]

    cache.take_events()
    assert cache.reset_prefix_cache() is True
    reset_events = cache.take_events()
    assert (
        encode_batch(KVEventBatch(ts=1700000000.25, events=reset_events, data_parallel_rank=0)).hex()
        == (reset_step["batch_payload_hex"])
    )
    assert cache.cached_block_hashes() == frozenset()


# --- reference model -------------------------------------------------------------------------------


class ReferencePool:
    """vLLM's prefix-cache rules restated with lists: slot i holds a digest or None; `free` is ordered,
    index 0 reused first; a hit takes the holder that got the digest earliest."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.block_size = block_size
        self.digest: list[bytes | None] = [None] * capacity
        self.stamp: list[int] = [0] * capacity
        self.free: list[int] = list(range(capacity))
        self.clock = 0

    def held(self) -> Counter[bytes]:
        return Counter(d for d in self.digest if d is not None)

    def _take(self) -> int:
        slot = self.free.pop(0)
        self.digest[slot] = None
        return slot

    def _store(self, slot: int, digest: bytes) -> None:
        self.clock += 1
        self.digest[slot] = digest
        self.stamp[slot] = self.clock

    def request(self, token_ids: list[int], digests: list[bytes], num_prompt: int) -> int:
        """Returns the number of cached (hit) tokens."""
        bs = self.block_size
        computed = len(token_ids) - 1 if len(token_ids) > num_prompt else len(token_ids)
        slots: list[int] = []
        for i in range((num_prompt - 1) // bs):
            holders = [s for s in range(len(self.digest)) if self.digest[s] == digests[i]]
            if not holders:
                break
            slots.append(min(holders, key=lambda s: self.stamp[s]))
        hits = len(slots)
        for s in slots:
            self.free.remove(s)
        # prefill
        while len(slots) * bs < num_prompt:
            slots.append(self._take())
        for i in range(hits, num_prompt // bs):
            self._store(slots[i], digests[i])
        # decode, one token per step
        for pos in range(num_prompt, computed):
            if pos == len(slots) * bs:
                slots.append(self._take())
            if (pos + 1) % bs == 0:
                self._store(slots[pos // bs], digests[pos // bs])
        # free in reverse: unhashed slots go to the front (keeping that order), hashed ones to the back
        released = list(reversed(slots))
        unhashed = [s for s in released if self.digest[s] is None]
        hashed = [s for s in released if self.digest[s] is not None]
        self.free = unhashed + self.free + hashed
        return hits * bs

    def reset(self) -> None:
        self.digest = [None] * len(self.digest)


def _apply_events(ledger: Counter[int], events: list[WireEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                assert isinstance(h, int)
                ledger[h] += 1
        elif isinstance(event, BlockRemoved):
            (h,) = event.block_hashes
            assert isinstance(h, int)
            assert ledger[h] > 0, "BlockRemoved for a hash never announced"
            ledger[h] -= 1
        else:
            assert isinstance(event, AllBlocksCleared)
            ledger.clear()


def _check_stored_event_shape(event: BlockStored, block_size: int) -> None:
    assert len(event.token_ids) == len(event.block_hashes) * block_size
    assert event.extra_keys == [None] * len(event.block_hashes)
    assert (event.block_size, event.medium, event.group_idx) == (block_size, "GPU", 0)
    assert (event.lora_id, event.lora_name) == (None, None)


@pytest.mark.parametrize("seed", range(6))
def test_cache_matches_reference_model_and_its_own_events(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    capacity = rng.randint(6, 14)
    cache = SimPrefixCache(capacity_blocks=capacity, block_size=block_size)
    model = ReferencePool(capacity, block_size)
    ledger: Counter[int] = Counter()
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 3 * block_size))] for _ in range(3)]
    previous: list[int] = []
    num_hits = num_evictions = num_duplicates = 0
    for step in range(150):
        if rng.random() < 0.04:
            assert cache.reset_prefix_cache() is True
            model.reset()
            _apply_events(ledger, cache.take_events())
            continue
        if previous and rng.random() < 0.3:
            prompt = previous + [rng.randrange(5) for _ in range(rng.randint(1, block_size + 1))]
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 2 * block_size))]
        num_output = rng.randint(1, 2 * block_size)
        token_ids = prompt + synthetic_output_tokens(prompt, num_output, vocab_size=5)
        if cache.num_blocks_needed(len(token_ids), len(prompt)) > capacity:
            with pytest.raises(CapacityError):
                cache.run(f"r{step}", token_ids, chained_digests(token_ids, block_size), len(prompt))
            continue
        previous = token_ids
        digests = chained_digests(token_ids, block_size)
        result = cache.run(f"r{step}", token_ids, digests, len(prompt))
        events = cache.take_events()
        assert events == result.events
        for event in events:
            if isinstance(event, BlockStored):
                _check_stored_event_shape(event, block_size)
        num_evictions += sum(isinstance(e, BlockRemoved) for e in events)

        assert result.num_cached_tokens == model.request(token_ids, digests, len(prompt))
        num_hits += result.num_cached_tokens > 0
        _apply_events(ledger, events)
        held = model.held()
        num_duplicates += sum(n > 1 for n in held.values())
        assert cache.block_hash_counts() == dict(held)
        assert +ledger == Counter({event_hash(d): n for d, n in held.items()})
        assert cache.cached_event_hashes() == set(+ledger)
    # The script must actually have exercised hits, evictions and vLLM's duplicate blocks.
    assert num_hits and num_evictions
    assert seed != 0 or num_duplicates


def test_block_aligned_full_hit_recomputes_and_reannounces_last_block() -> None:
    cache = SimPrefixCache(capacity_blocks=8, block_size=4)
    prompt = list(range(8))
    digests = chained_digests(prompt, 4)
    cache.run("a", prompt, digests)
    again = cache.run("b", prompt, digests)
    # vLLM caps the hit at len(prompt) - 1 tokens, so block 1 is computed again in a new block.
    assert again.num_cached_tokens == 4
    assert again.events == [
        BlockStored(
            block_hashes=[event_hash(digests[1])],
            parent_block_hash=event_hash(digests[0]),
            token_ids=prompt[4:],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert cache.block_hash_counts() == {digests[0]: 1, digests[1]: 2}


def test_decode_blocks_are_cached_so_the_next_turn_hits_them() -> None:
    cache = SimPrefixCache(capacity_blocks=16, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    output = synthetic_output_tokens(prompt, 7, vocab_size=1000)
    assert output == synthetic_output_tokens(prompt, 7, vocab_size=1000)
    first_turn = prompt + output  # 13 tokens, 12 computed: blocks 0-2 full
    result = cache.run("t1", first_turn, chained_digests(first_turn, 4), len(prompt))
    stored = [e for e in result.events if isinstance(e, BlockStored)]
    # Prefill announces block 0; each decode block is announced when it fills.
    assert [len(e.block_hashes) for e in stored] == [1, 1, 1]
    assert [e.token_ids for e in stored] == [first_turn[0:4], first_turn[4:8], first_turn[8:12]]
    second_turn = first_turn + [9, 9, 9]
    again = cache.run("t2", second_turn, chained_digests(second_turn, 4))
    assert again.num_cached_tokens == 12


def test_bad_requests_leave_the_cache_untouched() -> None:
    cache = SimPrefixCache(capacity_blocks=2, block_size=4)
    tokens = list(range(8))
    cache.run("a", tokens[:5], chained_digests(tokens[:5], 4))
    before = (
        cache.block_hash_counts(),
        cache.num_free_blocks,
        cache.prefix_cache_queries,
        cache.take_events(),
    )
    with pytest.raises(CapacityError):
        cache.run("big", list(range(100, 113)), chained_digests(list(range(100, 113)), 4))
    with pytest.raises(ValueError):
        cache.run("short", tokens, [])  # missing block hashes
    with pytest.raises(ValueError):
        cache.run("empty", [], [])
    with pytest.raises(ValueError):
        cache.run("prompt", tokens, chained_digests(tokens, 4), num_prompt_tokens=9)
    with pytest.raises(KeyError):
        cache.finish("nobody")
    assert (cache.block_hash_counts(), cache.num_free_blocks, cache.prefix_cache_queries) == before[:3]
    assert cache.take_events() == []
    with pytest.raises(ValueError):
        SimPrefixCache(capacity_blocks=0, block_size=4)


def test_reset_is_refused_while_a_request_holds_blocks() -> None:
    cache = SimPrefixCache(capacity_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    cache.admit("running", tokens, chained_digests(tokens, 2))
    with pytest.raises(ValueError):
        cache.admit("running", tokens, chained_digests(tokens, 2))
    cache.take_events()
    assert cache.reset_prefix_cache() is False
    assert cache.take_events() == []
    assert len(cache.cached_block_hashes()) == 2
    cache.finish("running")
    assert cache.reset_prefix_cache() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.cached_block_hashes() == frozenset()
    # Counters are cumulative, like vLLM's Prometheus counters.
    assert (cache.prefix_cache_queries, cache.prefix_cache_hits) == (5, 0)


def test_counters_count_prompt_and_hit_tokens() -> None:
    cache = SimPrefixCache(capacity_blocks=10, block_size=4)
    tokens = list(range(10))
    cache.run("a", tokens, chained_digests(tokens, 4))
    cache.run("b", tokens, chained_digests(tokens, 4))
    assert (cache.prefix_cache_queries, cache.prefix_cache_hits, cache.num_requests) == (20, 8, 2)


def test_block_hasher_digests_through_the_cache_give_vllm_payload_bytes() -> None:
    """Tokens -> BlockHasher -> SimPrefixCache -> msgpack equals the batch vLLM's BlockPool published."""
    from kvindex.hashing import BlockHasher

    prompt_48, steps = _plain_blockpool_case()
    digests = BlockHasher(algo="sha256", block_size=16, seed="0").block_hashes(prompt_48)
    cache = SimPrefixCache(capacity_blocks=7, block_size=16)
    cache.run("a", prompt_48[:17], digests[:1])
    second = cache.run("b", prompt_48 + [7], digests)
    (stored,) = second.events
    assert isinstance(stored, BlockStored)
    # vLLM's raw BlockPool leaves kv_cache_spec_kind unset (KVCacheManager.take_events adds it).
    as_blockpool = msgspec.structs.replace(stored, kv_cache_spec_kind=None)
    batch = KVEventBatch(ts=1700000000.25, events=[as_blockpool], data_parallel_rank=0)
    assert encode_batch(batch).hex() == steps[1]["batch_payload_hex"]
    assert cache.cached_event_hashes() == set(BlockHasher("sha256", 16, "0").event_hashes(prompt_48))
