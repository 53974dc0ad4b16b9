"""Shared parts of the API tests: a real IngestService subscribed to engines.Engine streams, the real HTTP
app on 127.0.0.1:0, and brute-force scores from what each engine holds (written from the CONTRACT.md
scoring rules, not from kvindex's scorer).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from engines import Engine
from kvindex.api.app import create_app
from kvindex.api.settings import ApiSettings
from kvindex.api.site import ApiSite
from kvindex.cli.process import event_loop_factory
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig
from waiting import wait_for

# Fast recovery when ZMQ's slow joiner drops the first live messages: probe replay quickly.
TEST_INGEST = IngestSettings(num_workers=2, quiet_probe_after_s=0.3, replay_timeout_s=2.0, index_shards=4)


def wait_until_ingested(service: IngestService, engines: Sequence[Engine], timeout_s: float = 15.0) -> None:
    """Every engine's last published seq has been applied by the service."""
    for engine in engines:
        engine.flush(5.0)

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


class HttpAnswer:
    """One HTTP answer as a test client read it."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class ServerThread:
    """The real aiohttp app on 127.0.0.1:0, on its own event loop in a thread (module-scoped fixtures)."""

    def __init__(
        self,
        service: IngestService,
        settings: ApiSettings | None = None,
        *,
        fast_score: bool = True,
        event_loop: str = "asyncio",
        **site_options: float,
    ) -> None:
        """`fast_score=False`: every request answered by aiohttp; `event_loop`: as `kvindex serve
        --event-loop` takes it; `site_options`: ApiSite's timeouts."""
        self._service = service
        self._fast_score = fast_score
        self._loop_factory = event_loop_factory(event_loop)[0]
        self._site_options = site_options
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
        """Stop serving and join the thread (again: nothing to do)."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15.0)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=self._loop_factory) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(create_app(self._service, self._settings), access_log=None)
        try:
            await runner.setup()
            site = ApiSite(runner, "127.0.0.1", 0, fast_score=self._fast_score, **self._site_options)
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


async def raw_exchange(
    url: str, head: list[str | bytes], body: bytes = b""
) -> tuple[list[int], dict[str, str], bytes]:
    """Send a request line and headers as given (bytes a client library would refuse included), then
    `body`, unless the server answers first; return every status line's code, and the final answer's
    headers (lower-case names) and body."""
    target = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(target.hostname, target.port)
    try:
        lines = [line.encode("latin-1") if isinstance(line, str) else line for line in head]
        lines += [f"Host: {target.netloc}".encode(), f"Content-Length: {len(body)}".encode()]
        writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
        expect100 = any(line.lower().startswith(b"expect:") for line in lines)
        if not expect100:
            writer.write(body)
        statuses: list[int] = []
        while True:
            statuses.append(int((await reader.readline()).split()[1]))
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if statuses[-1] != 100:
                break
            writer.write(body)  # told to go on
        return statuses, headers, await reader.readexactly(int(headers["content-length"]))
    finally:
        # The server may refuse a body it never reads: drop the connection rather than flush it.
        writer.transport.abort()
        await writer.wait_closed()
