"""Engine simulator, pure core: a vLLM-style prefix cache that emits the KV events vLLM would.

Source of the write path in demos and tests: sim/engine.py feeds it block hashes from a BlockHasher and
publishes the events it queues. Mirrors one full-attention KV-cache group of vLLM 0.33's
`BlockPool` + `KVCacheManager` (vllm/v1/core/block_pool.py, kv_cache_manager.py): same hit rule, same
free-queue LRU order, same event shapes and order. No clocks, sockets or threads.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
from kvindex.hashing import event_hash
from kvindex.replay.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, WireEvent

SPEC_KIND_FULL_ATTENTION = "full_attention"
# The simulated engine has one KV-cache group.
GROUP_IDX = 0


class CapacityError(ValueError):
    """The request needs more blocks than the cache can free for it (vLLM would queue it instead)."""


class SimRequestResult(msgspec.Struct, frozen=True):
    """What one request did to the cache. `events` are the ones this request queued, in order."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: (
        int  # prefix-cache hit, block aligned (vLLM's usage.prompt_tokens_details.cached_tokens)
    )
    num_output_tokens: int
    num_new_blocks: int  # blocks allocated from the free queue (each may have evicted a cached block)
    events: list[WireEvent]


def synthetic_output_tokens(prompt_token_ids: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """Deterministic stand-in for generated tokens: the same prompt always "generates" the same tokens.

    So a client can append them to its next turn and hit the blocks the decode phase cached, as with a
    real model at temperature 0.
    """
    if num_tokens <= 0:
        return []
    digest = hashlib.blake2b(",".join(map(str, prompt_token_ids)).encode(), digest_size=16).digest()
    # A private Random instance: no module-level state is touched.
    rng = random.Random(digest)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


class _Block:
    __slots__ = ("block_id", "block_hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: bytes | None = None
        self.ref_cnt = 0


class SimPrefixCache:
    """A fixed pool of `capacity_blocks` KV blocks with vLLM's automatic prefix caching.

    Rules (vLLM 0.33, one full-attention group, no null block counted in the capacity):
    - Only full blocks are cached, keyed by their block hash (raw digest).
    - Hit: the longest run of the prompt's leading block hashes that are cached, capped at
      `(num_prompt_tokens - 1) // block_size` blocks (vLLM recomputes the last prompt token to get logits;
      a fully cached, block-aligned prompt therefore recomputes, and re-announces, its last block).
    - Free blocks form one queue; allocation takes from the head and evicts the block's hash there
      (one BlockRemoved per hash). A finished request's blocks are freed in reverse order: hashed ones
      go to the tail, unhashed ones to the head, so a prompt's tail is evicted before its prefix.
    - Like vLLM, identical blocks are not de-duplicated: the same hash may be held by several blocks, each
      announced by its own BlockStored and withdrawn by its own BlockRemoved.
    - Every operation appends its events to a queue that `take_events` drains (one engine step).
    """

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks = [_Block(block_id) for block_id in range(capacity_blocks)]
        # Head = next to be reused (evicted). Values unused: OrderedDict gives O(1) removal from the middle.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity_blocks))
        # Insertion order matters: a hit takes the earliest block still holding the hash, as vLLM does.
        self._hash_to_block_ids: dict[bytes, list[int]] = {}
        self._request_to_block_ids: dict[str, list[int]] = {}
        self._pending_events: list[WireEvent] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries, tokens)
        self.prefix_cache_hits = 0  # of which were hits (vLLM's prefix_cache_hits, tokens)
        self.num_requests = 0
        self.num_resets = 0

    # --- queries ----------------------------------------------------------------------------------

    def cached_block_hashes(self) -> frozenset[bytes]:
        """Every digest some block currently holds (what an indexer should believe this pod has)."""
        return frozenset(self._hash_to_block_ids)

    def cached_event_hashes(self) -> frozenset[int]:
        return frozenset(event_hash(block_hash) for block_hash in self._hash_to_block_ids)

    def block_hash_counts(self) -> dict[bytes, int]:
        """How many blocks hold each cached digest (more than 1 only for vLLM's duplicate blocks)."""
        return {block_hash: len(ids) for block_hash, ids in self._hash_to_block_ids.items()}

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash (duplicates counted), whether in use or evictable."""
        return sum(len(ids) for ids in self._hash_to_block_ids.values())

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_running(self) -> int:
        return len(self._request_to_block_ids)

    def num_blocks_needed(self, num_tokens: int, num_prompt_tokens: int) -> int:
        """Blocks a request of `num_tokens` (prompt + output) holds at its end."""
        return -(-_num_computed_tokens(num_tokens, num_prompt_tokens) // self.block_size)

    # --- commands ---------------------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int | None = None,
    ) -> SimRequestResult:
        """Run a request's prefill and decode; its blocks stay in use until `finish(request_id)`.

        `token_ids` is the whole sequence (prompt, then output tokens); `block_hashes` the digests of its
        full blocks, in order (at least those of the computed span). As in vLLM the last output token is
        sampled but never computed, so it is in no block. Raises ValueError / CapacityError without
        changing any state.
        """
        num_tokens = len(token_ids)
        if num_prompt_tokens is None:
            num_prompt_tokens = num_tokens
        if request_id in self._request_to_block_ids:
            raise ValueError(f"request {request_id!r} is already running")
        if not 1 <= num_prompt_tokens <= num_tokens:
            raise ValueError(f"num_prompt_tokens must be in [1, {num_tokens}], got {num_prompt_tokens}")
        num_computed_tokens = _num_computed_tokens(num_tokens, num_prompt_tokens)
        block_size = self.block_size
        if len(block_hashes) < num_computed_tokens // block_size:
            raise ValueError(
                f"need {num_computed_tokens // block_size} block hashes, got {len(block_hashes)}"
            )

        hit_block_ids = self._find_longest_cache_hit(block_hashes, (num_prompt_tokens - 1) // block_size)
        num_hit_blocks = len(hit_block_ids)
        num_new_blocks = -(-num_computed_tokens // block_size) - num_hit_blocks
        num_evictable_hits = sum(1 for block_id in hit_block_ids if self._blocks[block_id].ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - num_evictable_hits:
            raise CapacityError(
                f"request needs {num_new_blocks} new blocks, only "
                f"{self.num_free_blocks - num_evictable_hits} can be freed (capacity {self.capacity_blocks})"
            )

        first_event = len(self._pending_events)
        self.num_requests += 1
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_blocks * block_size
        self._touch(hit_block_ids)
        request_block_ids = list(hit_block_ids)
        self._request_to_block_ids[request_id] = request_block_ids

        # Prefill step: allocate up to the end of the prompt, then cache its newly full blocks.
        request_block_ids += self._allocate(-(-num_prompt_tokens // block_size) - num_hit_blocks)
        num_cached_blocks = num_prompt_tokens // block_size
        self._cache_full_blocks(token_ids, block_hashes, request_block_ids, num_hit_blocks, num_cached_blocks)
        # Decode steps: token at `position` is computed; a block is allocated when it starts and cached
        # (one BlockStored each) when it fills.
        for position in range(num_prompt_tokens, num_computed_tokens):
            if position % block_size == 0:
                request_block_ids += self._allocate(1)
            if (position + 1) % block_size == 0:
                num_full_blocks = (position + 1) // block_size
                self._cache_full_blocks(
                    token_ids, block_hashes, request_block_ids, num_cached_blocks, num_full_blocks
                )
                num_cached_blocks = num_full_blocks

        return SimRequestResult(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=num_hit_blocks * block_size,
            num_output_tokens=num_tokens - num_prompt_tokens,
            num_new_blocks=num_new_blocks,
            events=self._pending_events[first_event:],
        )

    def finish(self, request_id: str) -> None:
        """Free a request's blocks (they stay cached, and become evictable). Emits nothing."""
        block_ids = self._request_to_block_ids.pop(request_id, None)
        if block_ids is None:
            raise KeyError(f"request {request_id!r} is not running")
        evict_first: list[int] = []
        evict_last: list[int] = []
        # NOTE: reverse order, so that the tail of a sequence is evicted before its prefix (vLLM).
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (evict_first if block.block_hash is None else evict_last).append(block_id)
        for block_id in reversed(evict_first):
            self._free_queue[block_id] = None
            self._free_queue.move_to_end(block_id, last=False)
        for block_id in evict_last:
            self._free_queue[block_id] = None

    def run(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int | None = None,
    ) -> SimRequestResult:
        """`admit` then `finish`: one request alone in the engine (the simulator's scheduler step)."""
        result = self.admit(request_id, token_ids, block_hashes, num_prompt_tokens)
        self.finish(request_id)
        return result

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash and queue AllBlocksCleared; refused (False, no event) while in use."""
        if self.num_free_blocks != self.capacity_blocks:
            return False
        self._hash_to_block_ids.clear()
        for block in self._blocks:
            block.block_hash = None
        self.num_resets += 1
        self._pending_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[WireEvent]:
        """Drain the queued events (what the engine publishes as one batch per step)."""
        events, self._pending_events = self._pending_events, []
        return events

    # --- mechanism --------------------------------------------------------------------------------

    def _find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[int]:
        hit_block_ids: list[int] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block_ids = self._hash_to_block_ids.get(block_hash)
            if not block_ids:
                break
            hit_block_ids.append(block_ids[0])
        return hit_block_ids

    def _touch(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_queue[block_id]
            block.ref_cnt += 1

    def _allocate(self, num_blocks: int) -> list[int]:
        """Take blocks from the head of the free queue, evicting the hash each one held."""
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                holders = self._hash_to_block_ids[block.block_hash]
                holders.remove(block_id)
                if not holders:
                    del self._hash_to_block_ids[block.block_hash]
                self._pending_events.append(
                    BlockRemoved(
                        block_hashes=[event_hash(block.block_hash)], medium=MEDIUM_GPU, group_idx=GROUP_IDX
                    )
                )
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def _cache_full_blocks(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        request_block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Hash blocks [num_cached_blocks, num_full_blocks) of the request and announce them as one run."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_hashes: list[int | bytes] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = self._blocks[request_block_ids[index]]
            block.block_hash = block_hashes[index]
            self._hash_to_block_ids.setdefault(block.block_hash, []).append(block.block_id)
            new_hashes.append(event_hash(block.block_hash))
        parent = event_hash(block_hashes[num_cached_blocks - 1]) if num_cached_blocks > 0 else None
        block_size = self.block_size
        self._pending_events.append(
            BlockStored(
                block_hashes=new_hashes,
                parent_block_hash=parent,
                token_ids=list(token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]),
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * len(new_hashes),
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=SPEC_KIND_FULL_ATTENTION,
            )
        )


def _num_computed_tokens(num_tokens: int, num_prompt_tokens: int) -> int:
    # The last sampled token is never fed back, so it never reaches the KV cache.
    return num_tokens - 1 if num_tokens > num_prompt_tokens else num_tokens
