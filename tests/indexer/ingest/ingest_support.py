"""Shared parts of the ingest pipeline tests (no tests here): engines are the project's EventPublisher on
127.0.0.1, and a reference model of what each engine holds, built from the events it sent by the
event rules (stored adds, removed drops, cleared empties, a restarted engine starts empty)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import zmq
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.replay.frames import replay_end_frames
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK_SIZE = 16
_token_counter = itertools.count(1)


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # ok


class Engine:
    """One (pod, dp rank) engine: a real EventPublisher plus what it holds (the reference)."""

    def __init__(
        self,
        pod_id: str,
        *,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        dp_rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        seed: str | None = None,
        offset_addresses: bool = True,
    ) -> None:
        """`offset_addresses=False`: the addresses are already this rank's (vLLM's offset not applied)."""
        self.ref = PodRef(pod_id, dp_rank)
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hasher = BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed=seed)
        self.held: set[int] = set()
        self.ever: set[int] = set()
        self.stored_order: list[list[int]] = []
        self.publisher = EventPublisher(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            buffer_steps=buffer_steps,
            dp_rank=dp_rank if offset_addresses else 0,
        )
        self.publisher.dp_rank = dp_rank
        self.dp_rank = dp_rank

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def store(self, num_blocks: int = 2) -> None:
        """One batch: a new prompt's blocks from block 0 (real hashes, so the hash check applies)."""
        base = next(_token_counter) * 1000
        tokens = [base + i for i in range(num_blocks * BLOCK_SIZE)]
        keys = self.hasher.event_hashes(tokens)
        event = BlockStored(
            block_hashes=list(keys),
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None] * len(keys),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        assert self.publisher.publish([event])
        self.held.update(keys)
        self.ever.update(keys)
        self.stored_order.append(keys)

    def remove_oldest(self) -> None:
        keys = next(k for k in self.stored_order if k[0] in self.held)
        assert self.publisher.publish([BlockRemoved(block_hashes=[keys[0]], medium="GPU", group_idx=0)])
        self.held.discard(keys[0])

    def clear(self) -> None:
        assert self.publisher.publish([AllBlocksCleared()])
        self.held.clear()

    def flush(self) -> None:
        assert self.publisher.flush(10)

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
                )
                break
            except zmq.ZMQError as exc:
                assert exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline, exc
                time.sleep(0.02)  # ok
        self.publisher.dp_rank = self.dp_rank

    def close(self) -> None:
        self.publisher.close()


def indexed_keys(index: KVIndex, pod: PodRef, universe: set[int]) -> set[int]:
    """The keys among `universe` that the index says `pod` holds (any tier)."""
    held = set()
    for key in universe:
        holders = index.lookup([key])
        if holders and any(entry_pod == pod for entry_pod, _ in holders[0]):
            held.add(key)
    return held


def index_matches(index: KVIndex, engines: list[Engine]) -> bool:
    universe = set().union(*(engine.ever for engine in engines))
    return all(indexed_keys(index, engine.ref, universe) == engine.held for engine in engines)


class SilentReplay:
    """A replay ROUTER that holds requests until released: keeps a worker busy deterministically."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity: bytes | None = None

    def wait_request(self, timeout_s: float = 10.0) -> None:
        assert self.router.poll(int(timeout_s * 1000)), "no replay request arrived"
        self.identity = self.router.recv_multipart()[0]

    def release(self) -> None:
        assert self.identity is not None
        self.router.send_multipart(replay_end_frames(self.identity))

    def close(self) -> None:
        self.ctx.destroy(linger=0)
