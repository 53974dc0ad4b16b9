"""The sidecar's HTTP side (aiohttp): `GET /v1/snapshot` (msgpack, or JSON on `Accept: application/json`),
`/v1/status`, `/healthz`, `/readyz` and `/metrics` (`kvindex_sidecar_*`, read from the relay's and the
ingest pipeline's plain counters at scrape time)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import msgspec
from aiohttp import web
from kvindex.indexer.snapshot import JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE, encode_snapshot
from kvindex.sidecar.service import SidecarService
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SERVICE_KEY = web.AppKey("sidecar_service", SidecarService)
_JSON = msgspec.json.Encoder()
_LABELS = ["pod", "dp_rank", "model"]


def _wants_json(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    types = [part.split(";")[0].strip() for part in accept.split(",")]
    return JSON_CONTENT_TYPE in types and MSGPACK_CONTENT_TYPE not in types


def _json_response(value: object, status: int = 200) -> web.Response:
    return web.Response(body=_JSON.encode(value), status=status, content_type=JSON_CONTENT_TYPE)


async def snapshot(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    as_json = _wants_json(request)
    # Off the event loop: a large block set takes a few ms to copy and encode.
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: encode_snapshot(service.snapshot(), as_json=as_json)
    )
    return web.Response(body=body, content_type=JSON_CONTENT_TYPE if as_json else MSGPACK_CONTENT_TYPE)


async def status(request: web.Request) -> web.Response:
    return _json_response(request.app[SERVICE_KEY].status())


async def healthz(request: web.Request) -> web.Response:
    return _json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    ready, reason = request.app[SERVICE_KEY].ready()
    if ready:
        return _json_response({"ready": True})
    return _json_response({"ready": False, "error": reason}, status=503)


class SidecarCollector(Collector):
    """`kvindex_sidecar_*`, per DP rank, read from the service at scrape time."""

    def __init__(self, service: SidecarService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        status = self._service.status()
        counters = {
            "batches_forwarded": "Engine batches forwarded downstream under the sidecar's seq.",
            "clears_emitted": "AllBlocksCleared batches the sidecar emitted (engine restart, lost history).",
            "restarts": "Engine restarts seen.",
            "history_lost": "Engine gaps older than the engine's replay ring.",
            "publish_dropped": "Batches the downstream queue refused (consumers need a snapshot).",
            "hash_checks": "BlockStored events whose hashes were recomputed.",
            "hash_mismatches": "BlockStored events whose recomputed hashes differ.",
            "hash_unverifiable": "BlockStored events with token ids that could not be recomputed.",
        }
        families = {
            name: CounterMetricFamily(f"kvindex_sidecar_{name}", text, labels=_LABELS)
            for name, text in counters.items()
        }
        seq = GaugeMetricFamily(
            "kvindex_sidecar_downstream_seq", "Newest downstream seq (-1: none yet).", labels=_LABELS
        )
        engine_seq = GaugeMetricFamily(
            "kvindex_sidecar_engine_seq", "Newest engine seq applied (-1: none yet).", labels=_LABELS
        )
        blocks = GaugeMetricFamily("kvindex_sidecar_blocks", "(block, tier) pairs held.", labels=_LABELS)
        partial = GaugeMetricFamily(
            "kvindex_sidecar_partial", "1 while the block set may miss engine history.", labels=_LABELS
        )
        connected = GaugeMetricFamily(
            "kvindex_sidecar_engine_connected", "1 while the engine link is up.", labels=_LABELS
        )
        for rank in status.ranks:
            labels = [status.pod, str(rank.dp_rank), status.model]
            relay = rank.relay
            for name, value in (
                ("batches_forwarded", relay.batches_forwarded),
                ("clears_emitted", relay.clears_emitted),
                ("restarts", relay.restarts),
                ("history_lost", relay.history_lost),
                ("publish_dropped", relay.publish_dropped),
                ("hash_checks", rank.hash_checks_total),
                ("hash_mismatches", rank.hash_mismatches_total),
                ("hash_unverifiable", rank.hash_unverifiable_total),
            ):
                families[name].add_metric(labels, value)
            seq.add_metric(labels, -1 if rank.downstream_seq is None else rank.downstream_seq)
            engine_seq.add_metric(labels, -1 if rank.engine.last_seq is None else rank.engine.last_seq)
            blocks.add_metric(labels, rank.blocks)
            partial.add_metric(labels, 1 if rank.partial else 0)
            connected.add_metric(labels, 0 if rank.engine.state == "disconnected" else 1)
        yield from families.values()
        yield from (seq, engine_seq, blocks, partial, connected)


def create_app(service: SidecarService) -> web.Application:
    app = web.Application()
    app[SERVICE_KEY] = service
    registry = CollectorRegistry()
    registry.register(SidecarCollector(service))

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/v1/snapshot", snapshot)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


class HttpThread:
    """The app on its own event loop thread (tests, the demo, benchmarks): `start()` returns the base
    URL once it listens; `stop()` closes it."""

    def __init__(self, service: SidecarService, host: str = "127.0.0.1", port: int = 0) -> None:
        self._app = create_app(service)
        self._host = host
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self._app, access_log=None)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvindex-sidecar-http", daemon=True
        )
        self.url = ""

    def start(self) -> str:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.url = future.result(timeout=10)
        return self.url

    async def _start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()
