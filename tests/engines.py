"""Engines for the tests that need a real KV-event stream but no simulator: the project's EventPublisher on
127.0.0.1 (PUB + replay ROUTER), plus a reference of what the engine holds, built from the events it sent
by the event rules (stored adds, removed drops, cleared empties, a restarted engine starts empty)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import zmq
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import PodRef
from kvindex.indexer.model import PodConfig
from kvindex.replay.endpoints import has_ephemeral_port, should_bind
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import AllBlocksCleared, BlockRemoved, BlockStored

PROMPT_BLOCK_SIZE = 16  # what store_prompt hashes with
_prompt_counter = itertools.count(1)


class Engine:
    """One (pod, dp rank) engine stream and what it holds: `held` maps block key -> tiers holding it."""

    def __init__(
        self,
        pod_id: str,
        *,
        model: str = "m",
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        dp_rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        hash_seed: str | None = None,
        offset_addresses: bool = True,
        bind: bool | None = None,
    ) -> None:
        """`offset_addresses=False`: the addresses are already this rank's (vLLM's DP offset not applied).
        `hash_seed` is what store_prompt hashes with (None: PYTHONHASHSEED unset, as the indexer expects)."""
        self.pod_id = pod_id
        self.model = model
        self.dp_rank = dp_rank
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hasher = BlockHasher(algo="sha256", block_size=PROMPT_BLOCK_SIZE, seed=hash_seed)
        self.held: dict[int, set[str]] = {}
        self.ever: set[int] = set()  # every key ever stored, held or not
        self.stored_order: list[list[int]] = []  # each stored batch's keys, oldest first
        # Whether the PUB binds (vLLM's rule unless told): a restart binds the same resolved address again.
        self.binds = bind if bind is not None else should_bind(endpoint) or has_ephemeral_port(endpoint)
        self.publisher = EventPublisher(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            buffer_steps=buffer_steps,
            dp_rank=dp_rank if offset_addresses else 0,
            bind=bind,
        )
        self.publisher.dp_rank = dp_rank  # the rank the batches carry, whichever address offset applied

    @property
    def ref(self) -> PodRef:
        return PodRef(self.pod_id, self.dp_rank)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def pod_config(self) -> PodConfig:
        """How a connect-mode indexer reaches this engine."""
        return PodConfig(
            pod_id=self.pod_id,
            endpoint=self.endpoint,
            model=self.model,
            replay_endpoint=self.replay_endpoint,
            dp_rank=self.dp_rank,
        )

    def store(
        self,
        block_keys: Sequence[int],
        token_ids: Sequence[int],
        *,
        block_size: int,
        parent: int | None = None,
        tier: str = "GPU",
        lora_name: str | None = None,
        extra_keys: list[Any] | None = None,
        kv_cache_spec_kind: str | None = None,
    ) -> None:
        """One batch of one BlockStored with the caller's keys (the index trusts them as given)."""
        keys = list(block_keys)
        event = BlockStored(
            block_hashes=keys,
            parent_block_hash=parent,
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=None,
            medium=tier,
            lora_name=lora_name,
            extra_keys=extra_keys if extra_keys is not None else [None] * len(keys),
            group_idx=0,
            kv_cache_spec_kind=kv_cache_spec_kind,
        )
        assert self.publisher.publish([event])
        for key in keys:
            self.held.setdefault(key, set()).add(tier)
        self.ever.update(keys)
        self.stored_order.append(keys)

    def store_chain(
        self,
        all_keys: Sequence[int],
        token_ids: Sequence[int],
        *,
        block_size: int,
        start: int,
        stop: int,
        tier: str = "GPU",
    ) -> None:
        """Store blocks [start, stop) of a prompt whose chained keys are `all_keys`."""
        self.store(
            all_keys[start:stop],
            token_ids[start * block_size : stop * block_size],
            block_size=block_size,
            parent=all_keys[start - 1] if start > 0 else None,
            tier=tier,
        )

    def store_prompt(self, num_blocks: int = 2) -> None:
        """One batch: a new prompt's first `num_blocks` blocks, with real hashes (so the hash check
        applies), in vLLM 0.33's full event shape."""
        base = next(_prompt_counter) * 1000
        tokens = [base + i for i in range(num_blocks * PROMPT_BLOCK_SIZE)]
        keys = self.hasher.event_hashes(tokens)
        self.store(keys, tokens, block_size=PROMPT_BLOCK_SIZE, kv_cache_spec_kind="full_attention")

    def remove(self, block_keys: Iterable[int], *, tier: str = "GPU", group_idx: int | None = None) -> None:
        keys = list(block_keys)
        assert self.publisher.publish([BlockRemoved(block_hashes=keys, medium=tier, group_idx=group_idx)])
        for key in keys:
            tiers = self.held.get(key, set())
            tiers.discard(tier)
            if not tiers:
                self.held.pop(key, None)

    def remove_oldest(self) -> None:
        """Evict the first block of the oldest stored batch still held (on GPU)."""
        keys = next(k for k in self.stored_order if k[0] in self.held)
        self.remove([keys[0]], group_idx=0)

    def clear(self) -> None:
        assert self.publisher.publish([AllBlocksCleared()])
        self.held.clear()

    def flush(self, timeout_s: float = 10.0) -> None:
        assert self.publisher.flush(timeout_s)

    def restart(self) -> None:
        """A new engine process on the same addresses: seq from 0, empty ring, empty cache."""
        endpoint, replay = self.endpoint, self.replay_endpoint
        self.publisher.close()
        self.held.clear()
        # ZMQ releases a closed socket's port asynchronously: retry the bind until it is free.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.publisher = EventPublisher(
                    endpoint,
                    replay_endpoint=replay,
                    topic=self.topic,
                    buffer_steps=self.buffer_steps,
                    dp_rank=0,  # the addresses are already the effective (offset) ones
                    bind=self.binds,  # a resolved address, which vLLM's rule alone would connect to
                )
                break
            except zmq.ZMQError as exc:
                assert exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline, exc
                time.sleep(0.02)  # ok: retrying a bind under a deadline
        self.publisher.dp_rank = self.dp_rank

    def close(self) -> None:
        self.publisher.close()
