"""`kvindex serve`: the indexer service process.

Flags + TOML (cli/config.py) -> IngestService (the write path) + the aiohttp app (the read path).
Prints `kvindex serve: listening on http://HOST:PORT` once the HTTP socket is bound (port 0 resolved),
and stops cleanly on SIGTERM or SIGINT: HTTP first, then ingest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from kvindex.cli.main import CliError
from kvindex.cli.model_flags import add_hash_flags
from kvindex.cli.process import EVENT_LOOPS

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvindex.cli.config import ServeConfig
    from kvindex.indexer.ingest import IngestService
    from kvindex.indexer.model import ModelConfig
    from kvindex.indexer.store import Store

logger = logging.getLogger("kvindex.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--http", metavar="HOST:PORT", help="where to serve the HTTP API (default 0.0.0.0:8080)"
    )
    parser.add_argument(
        "--pod",
        action="append",
        metavar="ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,dp_rank=N][,snapshot=URL]",
        help="connect mode: dial this engine's PUB socket (and ROUTER replay socket); repeatable. With a "
        "sidecar (kvindex sidecar), dial the sidecar's sockets and give snapshot=http://HOST:8081/v1/snapshot: "
        "a join or a gap older than the ring then loads the sidecar's state (exact)",
    )
    parser.add_argument(
        "--listen",
        action="append",
        metavar="ENDPOINT",
        help="bind mode: bind a SUB socket here for engines that dial in (topic kv@<pod>@<model>); repeatable. "
        "vLLM offsets the endpoint an engine dials by its data-parallel rank (rank r of "
        "tcp://kvindex:5557 dials port 5557+r), so bind one --listen per rank: "
        "--listen tcp://*:5557 --listen tcp://*:5558 for DP size 2",
    )
    parser.add_argument(
        "--listen-replay",
        metavar="TEMPLATE",
        help="bind mode: replay endpoint of a pod that dialled in, e.g. tcp://{pod}:5558 (placeholders {pod} "
        "and {model}; no rank placeholder: rank r > 0 is reached at the template's port + r, as vLLM offsets "
        "each rank's replay socket); default: no replay, so a gap clears the pod until it resyncs",
    )
    parser.add_argument(
        "--listen-snapshot",
        metavar="TEMPLATE",
        help="bind mode: snapshot URL of a dialled-in pod's sidecar, e.g. http://{pod}:8081/v1/snapshot "
        "(placeholders {pod} and {model}); default: no snapshots",
    )
    parser.add_argument("--model", metavar="NAME", help="the model served (or the one the next flags change)")
    add_hash_flags(parser, whose="the engines'")
    parser.add_argument(
        "--min-live-pods",
        type=int,
        metavar="N",
        help="/readyz answers 200 once at least N pods are live and no reachable pod is in its first sync "
        "(default 1; 0: ready without any)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        metavar="MS",
        help="the GIL switch interval (sys.setswitchinterval): shorter hands the GIL from ingest threads "
        "to the score path sooner (default 1; Python's own default is 5)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help="the HTTP API's event loop: auto takes uvloop when installed (lower score latency), else "
        "asyncio's own (default auto)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (health, readiness and metrics stay open); "
        "default: the KVINDEX_API_KEY environment variable, then the config file's api_key, else none. "
        "Prefer the variable: a flag shows in ps",
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        help="keep the index in Redis/Valkey (redis://HOST:PORT/DB, rediss:// for TLS; a Redis Cluster: "
        "redis+cluster://HOST:PORT or rediss+cluster://, or a redis:// node found in cluster mode), shared by every "
        "replica given the same URL and pods; each pod is ingested by the replica holding its lease. "
        "Default: in memory, in this process",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        metavar="SECONDS",
        help="with --store: another replica takes a pod over once its owner has not renewed the pod's "
        "lease for this long (default 10)",
    )
    parser.add_argument(
        "--replica-id",
        metavar="ID",
        help="with --store: this replica's name in leases and /v1/pods; unset: host:pid",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with models, pods, tiers, limits, ingest")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="log verbosity (default info)"
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: aiohttp, ZMQ and the index are only paid for by `kvindex serve` itself.
    from kvindex.cli import process
    from kvindex.cli.config import ConfigError, build_serve_config
    from kvindex.indexer.ingest import IngestService

    try:
        config = build_serve_config(args, os.environ)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    _configure_logging(config.log_level)
    try:
        loop_factory, loop_line = process.event_loop_factory(config.event_loop)
    except process.EventLoopUnavailable as exc:
        raise CliError(str(exc)) from None
    # Before any ingest thread starts: the score path shares the GIL with them (see config.py).
    process.set_switch_interval(config.switch_interval_ms)
    process.raise_open_files_limit()
    process.pin_mmap_threshold()
    try:
        service = IngestService(
            config.models,
            config.pods,
            listen=config.listen,
            settings=config.ingest,
            release_heap=process.heap_releaser(),
            store_factory=_store_factory(config),
        )
    except ValueError as exc:
        raise CliError(f"cannot set up ingest: {exc}") from None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(service, config, loop_line))


def _store_factory(config: ServeConfig) -> Callable[[ModelConfig], Store] | None:
    """Each model's Redis store (one client shared by all), or None for the in-memory index. The
    store need not be reachable yet: replicas start before it, and wait (503) until it answers."""
    if config.store.url is None:
        return None
    from kvindex.indexer.stores.redis_store import RedisStore, connect

    client = connect(config.store.url, socket_timeout_s=config.store.socket_timeout_s)
    ingest = config.ingest

    def make(model: ModelConfig) -> Store:
        return RedisStore(
            client,
            model.name,
            num_shards=config.store.num_shards,
            max_keys=ingest.index_max_keys,
            max_pods_per_key=ingest.index_max_pods_per_key,
        )

    return make


def _log_settings(service: IngestService, config: ServeConfig, loop_line: str) -> None:
    """One line per model, pod and bind endpoint, so an operator can check them against the engines."""
    from kvindex.api import answer as answer_writer
    from kvindex.api import id_arrays as request_reader
    from kvindex.hashing import compiled as hash_core
    from kvindex.indexer import compiled as index_core

    logger.info("%s", loop_line)
    logger.info("GIL switch interval %.3g ms", sys.getswitchinterval() * 1000)
    logger.info("%s", hash_core.describe())
    logger.info("%s", index_core.describe())
    logger.info("%s", request_reader.describe())
    logger.info("%s", answer_writer.describe())
    if config.api_key_source is None:
        logger.info("HTTP API: no API key, /v1/* is open to whoever reaches the port")
    else:  # never the key itself
        logger.info("HTTP API: /v1/* requires the API key (from %s)", config.api_key_source)
    for model in config.models:
        runtime = service.model(model.name)
        root = runtime.hasher.root.hex()[:16] if runtime is not None else "?"
        seed = "unset" if model.hash_seed is None else repr(model.hash_seed)
        logger.info(
            "model %s: block size %d, hash algo %s, seed %s (%s), root %s…, prefix groups %s",
            model.name,
            model.block_size,
            model.hash_algo,
            seed,
            config.seed_sources.get(model.name, "?"),
            root,
            ",".join(str(group) for group in sorted(model.prefix_group_idxs)),
        )
    if service.leases is not None:
        from kvindex.indexer.stores.redis_store import redacted

        logger.info(
            "index in %s, shared by replicas; this replica is %s, lease TTL %.3g s",
            redacted(config.store.url or ""),
            service.leases.replica_id,
            config.ingest.lease_ttl_s,
        )
    for pod in config.pods:
        logger.info(
            "pod %s dp rank %d (model %s, from %s): events %s, replay %s, snapshot %s",
            pod.pod_id,
            pod.dp_rank,
            pod.model,
            config.pod_sources.get((pod.pod_id, pod.dp_rank), "?"),
            pod.endpoint,
            pod.replay_endpoint or "none (gaps lose history)",
            pod.snapshot_url or "none",
        )
    for asked, bound in zip(config.listen, service.listen_endpoints, strict=False):
        logger.info(
            "listening for engines on %s (bound %s), replay template %s",
            asked,
            bound,
            config.ingest.listen_replay_template or "none (gaps lose history)",
        )


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _dialled_hosts(config: ServeConfig) -> list[tuple[str, str, int]]:
    """(who, host, port) of every tcp:// endpoint kvindex dials, for the start-up DNS check."""
    from kvindex.replay.endpoints import tcp_host_port

    targets = []
    for pod in config.pods:
        for what, endpoint in (("events", pod.endpoint), ("replay", pod.replay_endpoint)):
            host_port = tcp_host_port(endpoint) if endpoint is not None else None
            if host_port is not None:
                targets.append((f"pod {pod.pod_id!r} dp rank {pod.dp_rank} ({what})", *host_port))
    return targets


async def _serve(service: IngestService, config: ServeConfig, loop_line: str) -> int:
    from aiohttp import web
    from kvindex.api.app import create_app
    from kvindex.api.site import ApiSite
    from kvindex.cli import process
    from kvindex.cli.dns_check import log_unresolved_hosts

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    app = create_app(service, config.api, manage_service=True)
    access_log = logging.getLogger("aiohttp.access") if config.log_level == "debug" else None
    runner = web.AppRunner(app, handle_signals=False, access_log=access_log)
    try:
        await runner.setup()  # starts the ingest service (the app's cleanup_ctx owns it)
    except Exception as exc:
        await loop.run_in_executor(None, service.stop)
        raise CliError(f"ingest failed to start: {exc}") from None
    process.freeze_startup_heap()
    try:
        # The debug level's access log sees only what aiohttp answers: there, every request goes to aiohttp.
        site = ApiSite(runner, config.api.host, config.api.port, fast_score=access_log is None)
        try:
            await site.start()
        except OSError as exc:
            raise CliError(
                f"cannot listen on {config.api.host}:{config.api.port} ({exc.strerror or exc}); pick another --http"
            ) from None
        host, port = runner.addresses[0][:2]
        shown_host = f"[{host}]" if ":" in host else host
        print(f"kvindex serve: listening on http://{shown_host}:{port}", flush=True)
        _log_settings(service, config, loop_line)
        if access_log is None:
            logger.info("score fast path: on (plain POST /v1/score answered before aiohttp)")
        else:
            logger.info("score fast path: off (--log-level debug: aiohttp's access log sees every request)")
        log_unresolved_hosts(_dialled_hosts(config), logger)
        await stop.wait()
        logger.info("signal received, stopping")
    finally:
        await runner.cleanup()  # stops HTTP, then the ingest service
    logger.info("stopped")
    return 0
