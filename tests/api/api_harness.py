"""Shared parts of the API tests: simulated engine pods publishing real KV-event streams, a real
IngestService subscribed to them, the real HTTP app on 127.0.0.1:0, and a brute-force reference of
what each pod holds (written from the CONTRACT.md scoring rules, not from kvindex's scorer).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from kvindex.api.app import create_app
from kvindex.api.settings import ApiSettings
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import BlockRemoved, BlockStored

# Fast recovery when ZMQ's slow joiner drops the first live messages: probe replay quickly.
TEST_INGEST = IngestSettings(num_workers=2, quiet_probe_after_s=0.3, replay_timeout_s=2.0, index_shards=4)


def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)  # ok: polling a condition with a deadline


@dataclass
class Engine:
    """One simulated engine stream (pod, dp rank) and a reference copy of what it holds."""

    pod_id: str
    model: str
    publisher: EventPublisher
    dp_rank: int = 0
    # reference model: block key -> tiers holding it
    held: dict[int, set[str]] = field(default_factory=dict)

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
    ) -> None:
        event = BlockStored(
            block_hashes=list(block_keys),
            parent_block_hash=parent,
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=None,
            medium=tier,
            lora_name=lora_name,
            extra_keys=extra_keys if extra_keys is not None else [None] * len(block_keys),
            group_idx=0,
        )
        assert self.publisher.publish([event])
        for key in block_keys:
            self.held.setdefault(key, set()).add(tier)

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

    def remove(self, block_keys: Iterable[int], *, tier: str = "GPU") -> None:
        keys = list(block_keys)
        assert self.publisher.publish([BlockRemoved(block_hashes=keys, medium=tier)])
        for key in keys:
            tiers = self.held.get(key, set())
            tiers.discard(tier)
            if not tiers:
                self.held.pop(key, None)

    def pod_config(self) -> PodConfig:
        return PodConfig(
            pod_id=self.pod_id,
            endpoint=self.publisher.endpoint,
            model=self.model,
            replay_endpoint=self.publisher.replay_endpoint,
            dp_rank=self.dp_rank,
        )


def new_engine(pod_id: str, model: str, *, dp_rank: int = 0) -> Engine:
    publisher = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", dp_rank=dp_rank)
    return Engine(pod_id=pod_id, model=model, publisher=publisher, dp_rank=dp_rank)


def wait_until_ingested(service: IngestService, engines: Sequence[Engine], timeout_s: float = 15.0) -> None:
    """Every engine's last published seq has been applied by the service."""
    for engine in engines:
        assert engine.publisher.flush(5.0)

    def caught_up() -> bool:
        last_seq = {(s.pod, s.dp_rank): s.last_seq for s in service.pod_statuses()}
        return all(
            last_seq.get((e.pod_id, e.dp_rank)) == e.publisher.last_seq
            for e in engines
            if e.publisher.last_seq is not None
        )

    wait_for(caught_up, timeout_s=timeout_s, what="ingest to apply every published batch")


def reference_scores(
    engines: Sequence[Engine],
    block_keys: Sequence[int],
    *,
    block_size: int,
    tier_weights: dict[str, float],
    unknown_tier_weight: float,
    pods: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """CONTRACT.md by brute force: the leading run each stream holds (any tier); per tier, the leading
    run held on that tier alone (GPU and CPU always, 0 when none; other tiers with none left out); each
    block of the run weighted by its best tier; zero runs omitted; best first."""
    out = []
    for engine in engines:
        if pods is not None and engine.pod_id not in pods:
            continue
        run = 0
        score = 0.0
        for key in block_keys:
            tiers = engine.held.get(key)
            if not tiers:
                break
            run += 1
            score += max(tier_weights.get(t, unknown_tier_weight) for t in tiers)
        by_tier: dict[str, int] = {"GPU": 0, "CPU": 0}
        for tier in {t for key in block_keys[:1] for t in engine.held.get(key, set())}:
            tier_run = 0
            while tier_run < len(block_keys) and tier in engine.held.get(block_keys[tier_run], set()):
                tier_run += 1
            by_tier[tier] = tier_run
        if run:
            out.append(
                {
                    "pod": engine.pod_id,
                    "dp_rank": engine.dp_rank,
                    "matched_blocks": run,
                    "matched_tokens": run * block_size,
                    "score": score,
                    "by_tier": by_tier,
                }
            )
    out.sort(key=lambda s: (-s["score"], -s["matched_blocks"], s["pod"], s["dp_rank"]))
    return out


class ServerThread:
    """The real aiohttp app on 127.0.0.1:0, on its own event loop in a thread (module-scoped fixtures)."""

    def __init__(self, service: IngestService, settings: ApiSettings | None = None) -> None:
        self._service = service
        self._settings = settings or ApiSettings(host="127.0.0.1", port=0)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="test-http", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(15.0):
            raise AssertionError("HTTP server did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15.0)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(create_app(self._service, self._settings), access_log=None)
        try:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


def start_service(models: Sequence[ModelConfig], engines: Sequence[Engine]) -> IngestService:
    service = IngestService(list(models), [e.pod_config() for e in engines], settings=TEST_INGEST)
    service.start()
    wait_for(service.ready, what="the ingest service to finish its initial sync")
    return service
