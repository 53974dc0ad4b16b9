"""`kvindex sidecar`: beside one engine pod, its KV-event stream relayed under the sidecar's own seq and
the pod's block set served as a snapshot (sidecar/). Prints `kvindex sidecar: listening on http://HOST:PORT`
once the HTTP socket is bound, and stops cleanly on SIGTERM or SIGINT."""

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

if TYPE_CHECKING:
    from kvindex.sidecar.service import SidecarService
    from kvindex.sidecar.settings import SidecarSettings

logger = logging.getLogger("kvindex.sidecar")

EPILOG = """\
beside a vLLM engine (same pod, loopback), with kvindex dialling the sidecar:
  vllm serve $MODEL --enable-prefix-caching --kv-events-config \\
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
  kvindex sidecar --pod pod-a --model $MODEL
  kvindex serve --model $MODEL --pod pod-a=tcp://pod-a:5567,replay=tcp://pod-a:5568,snapshot=http://pod-a:8081/v1/snapshot

or dialling a central kvindex's --listen (topic kv@<pod>@<model>):
  kvindex sidecar --pod pod-a --model $MODEL --publish tcp://kvindex:5557
  kvindex serve --model $MODEL --listen 'tcp://*:5557' --listen-replay 'tcp://{pod}:5568' \\
    --listen-snapshot 'http://{pod}:8081/v1/snapshot'

DP ranks: one --engine (and --engine-replay) per rank, as vLLM offsets them; downstream rank r uses
--publish and --replay with port + r, as vLLM would.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--pod", required=True, metavar="ID", help="the pod id (no '@'); downstream topic kv@ID@MODEL"
    )
    parser.add_argument("--model", metavar="NAME", help="the model the engine serves (required)")
    parser.add_argument(
        "--engine",
        action="append",
        metavar="ENDPOINT",
        help="the engine's PUB socket, one per DP rank in rank order (default tcp://127.0.0.1:5557)",
    )
    parser.add_argument(
        "--engine-replay",
        action="append",
        metavar="ENDPOINT",
        help="the engine's replay ROUTER, one per --engine (default tcp://127.0.0.1:5558 with the default "
        "--engine; none: gaps lose history)",
    )
    parser.add_argument(
        "--publish",
        metavar="ENDPOINT",
        help="downstream PUB (default tcp://*:5567): a * binds, a host name connects (a central kvindex's "
        "--listen); rank r uses port + r",
    )
    parser.add_argument(
        "--replay",
        metavar="ENDPOINT",
        help="downstream replay ROUTER (default tcp://*:5568; rank r: port + r)",
    )
    parser.add_argument(
        "--http", metavar="HOST:PORT", help="snapshot, status and metrics (default 0.0.0.0:8081)"
    )
    parser.add_argument(
        "--buffer-steps",
        type=int,
        metavar="N",
        help="downstream replay ring, batches per rank (default 10000)",
    )
    add_hash_flags(parser, whose="the engine's")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file (kvindex serve's) whose [[models]] entry is read"
    )
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info", help="log verbosity"
    )


def build_settings(args: argparse.Namespace) -> SidecarSettings:
    """The sidecar's settings from its flags; CliError naming the flag to fix."""
    from kvindex.cli.config import ConfigError, build_sidecar_model, parse_host_port
    from kvindex.replay.endpoints import endpoint_problem, should_bind
    from kvindex.sidecar import settings as defaults

    try:
        model = build_sidecar_model(args, os.environ)
        host, port = parse_host_port(
            args.http or f"{defaults.DEFAULT_HTTP_HOST}:{defaults.DEFAULT_HTTP_PORT}"
        )
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if not args.pod or "@" in args.pod:
        raise CliError(f"--pod {args.pod!r} must be a non-empty id without '@'")
    engines = tuple(args.engine or (defaults.DEFAULT_ENGINE,))
    if args.engine_replay is not None:
        replays: tuple[str | None, ...] = tuple(args.engine_replay)
    elif args.engine is None:
        replays = (defaults.DEFAULT_ENGINE_REPLAY,)
    else:
        replays = (None,) * len(engines)
    if len(replays) != len(engines):
        raise CliError(f"give one --engine-replay per --engine ({len(engines)}), got {len(replays)}")
    for flag, endpoint, dial in (
        *(("--engine", e, True) for e in engines),
        *(("--engine-replay", r, True) for r in replays if r is not None),
        ("--publish", args.publish or defaults.DEFAULT_PUBLISH, not should_bind(args.publish or "*")),
        ("--replay", args.replay or defaults.DEFAULT_REPLAY, False),
    ):
        problem = endpoint_problem(endpoint, dial=dial)
        if problem is not None:
            raise CliError(f"{flag} {endpoint!r} {problem}")
    buffer_steps = args.buffer_steps if args.buffer_steps is not None else 10_000
    if buffer_steps < 1:
        raise CliError(f"--buffer-steps must be >= 1, got {buffer_steps}")
    return defaults.SidecarSettings(
        pod_id=args.pod,
        model=model,
        engines=engines,
        engine_replays=replays,
        publish=args.publish or defaults.DEFAULT_PUBLISH,
        replay=args.replay or defaults.DEFAULT_REPLAY,
        http_host=host,
        http_port=port,
        buffer_steps=buffer_steps,
    )


def run(args: argparse.Namespace) -> int:
    from kvindex.cli import process
    from kvindex.sidecar.service import SidecarService

    settings = build_settings(args)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    process.pin_mmap_threshold()
    try:
        service = SidecarService(settings, release_heap=process.heap_releaser())
    except Exception as exc:  # zmq address errors: one sentence
        raise CliError(f"cannot set up the sidecar: {exc}") from None
    return asyncio.run(_serve(service))


async def _serve(service: SidecarService) -> int:
    from aiohttp import web
    from kvindex.sidecar.http import create_app

    settings = service.settings
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await loop.run_in_executor(None, service.start)
    except Exception as exc:
        await loop.run_in_executor(None, service.stop)
        raise CliError(f"the sidecar failed to start: {exc}") from None
    runner = web.AppRunner(create_app(service), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.http_host, settings.http_port)
        try:
            await site.start()
        except OSError as exc:
            raise CliError(
                f"cannot listen on {settings.http_host}:{settings.http_port} ({exc.strerror or exc}); pick another --http"
            ) from None
        host, port = runner.addresses[0][:2]
        print(f"kvindex sidecar: listening on http://{host}:{port}", flush=True)
        model = settings.model
        for rank, publisher in sorted(service.publishers.items()):
            logger.info(
                "pod %s rank %d (model %s, block size %d, %s): engine %s replay %s -> publish %s replay %s",
                settings.pod_id,
                rank,
                model.name,
                model.block_size,
                model.hash_algo,
                settings.engines[rank],
                settings.engine_replays[rank] if settings.engine_replays else None,
                publisher.endpoint,
                publisher.replay_endpoint,
            )
        await stop.wait()
        logger.info("signal received, stopping")
    finally:
        await runner.cleanup()
        await loop.run_in_executor(None, service.stop)
    return 0
