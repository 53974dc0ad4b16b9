"""`kvindex sim`: a fleet of simulated vLLM engines publishing real KV-event streams.

Each engine (sim/engine.py) serves a minimal OpenAI-style HTTP API on its own port and publishes
vLLM-compatible KV events (PUB + replay ROUTER), so `kvindex serve` can index it like a real vLLM pod.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import random
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from kvindex.cli.main import CliError
from kvindex.replay.endpoints import endpoint_problem

if TYPE_CHECKING:  # the CLI imports every subcommand module: keep ZMQ and aiohttp out of start-up
    from kvindex.sim.engine import SimEngine, SimEngineConfig

DEFAULT_REPLAY_PORT = 5600

EPILOG = """\
how to start a fleet
  Engines bind, kvindex dials them (kvindex's connect mode, `--pod`; like vLLM's default endpoint
  tcp://*:5557): engine i binds PUB on port 5557+i and replay on
  5600+i; the printed `kvindex serve` flags dial them:
      kvindex sim --engines 4 --pub 'tcp://*:5557' --replay 'tcp://*:5600' --http-port-base 8200
      kvindex serve --model sim-model --block-size 16 --hash-algo sha256 --pod sim-0=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5600,model=sim-model ...

  Engines dial kvindex (kvindex's bind mode, `--listen`): every engine dials the one address, and
  publishes under the topic kv@<pod>@<model>; replay sockets bind on --pub's host (loopback here) at
  5600+i. The printed `kvindex serve --listen` flags bind it:
      kvindex sim --engines 4 --pub tcp://127.0.0.1:5557
      kvindex serve --listen tcp://127.0.0.1:5557 --model sim-model --block-size 16 --hash-algo sha256

  Ephemeral ports everywhere (tests, CI; replay follows --pub), drive 50 shared-prefix requests and exit:
      kvindex sim --engines 2 --pub tcp://127.0.0.1:0 --http-port-base 0 --requests 50

  Talk to an engine (token ids only; usage.prompt_tokens_details.cached_tokens is the prefix-cache hit):
      curl -s localhost:8200/v1/completions -d '{"model": "sim-model", "prompt": [1,2,3], "max_tokens": 4}'
      curl -s localhost:8200/metrics ; curl -X POST localhost:8200/reset_prefix_cache

  The hash seed defaults to $PYTHONHASHSEED, as in vLLM; give the indexer the same algorithm, seed and
  block size. Stop with Ctrl-C (SIGINT) or SIGTERM.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--engines", type=int, default=1, help="number of simulated engines (default 1)")
    parser.add_argument(
        "--model", default="sim-model", help="model name the engines serve (default sim-model)"
    )
    parser.add_argument("--pod-prefix", default="sim-", help="engine i is the pod <prefix><i> (default sim-)")
    parser.add_argument(
        "--capacity-blocks", type=int, default=4096, help="KV blocks per engine (default 4096)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16, as vLLM)")
    parser.add_argument(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="vLLM's --prefix-caching-hash-algo (default sha256)",
    )
    parser.add_argument(
        "--hash-seed",
        default=os.environ.get("PYTHONHASHSEED"),
        help="the PYTHONHASHSEED the engines hash with (default: $PYTHONHASHSEED; unset = vLLM's rule)",
    )
    parser.add_argument("--http-host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument(
        "--http-port-base",
        type=int,
        default=8200,
        help="engine i serves HTTP on base+i; 0 = ephemeral (default 8200)",
    )
    parser.add_argument(
        "--pub",
        default="tcp://*:5557",
        help="PUB endpoint: with * (or port 0) engine i binds port+i and kvindex dials it (kvindex's connect "
        "mode, `kvindex serve --pod`); with a host every engine dials it there (kvindex's bind mode, "
        "`kvindex serve --listen`) (default tcp://*:5557)",
    )
    parser.add_argument(
        "--replay",
        default=None,
        help="replay ROUTER endpoint, always bound; engine i uses port+i; 'none' disables (default: port "
        f"{DEFAULT_REPLAY_PORT} on --pub's host, or on every interface when --pub names another machine; "
        "ephemeral when --pub's port is)",
    )
    parser.add_argument(
        "--topic",
        default=None,
        help="ZMQ topic; may use {pod} and {model} (default: kv@{pod}@{model} when the engines dial kvindex, "
        "whose bind mode reads pod and model from it; empty when kvindex dials them, its connect mode)",
    )
    parser.add_argument(
        "--buffer-steps", type=int, default=10_000, help="replay ring size in batches (default 10000)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="drive N shared-prefix requests through the HTTP API, then exit",
    )
    parser.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the --requests workload (default 0)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="max_tokens of the --requests workload (default 8)"
    )


def run(args: argparse.Namespace) -> int:
    from kvindex.sim.engine import SimEngine

    try:
        engines = [SimEngine(config) for config in engine_configs(args)]
    except ValueError as exc:  # HashingError: unknown algorithm, bad seed or block size
        raise CliError(str(exc)) from exc
    return asyncio.run(_serve(engines, args, sys.stdout))


def engine_configs(args: argparse.Namespace) -> list[SimEngineConfig]:
    """One config per engine from the command line; raises CliError for unusable values."""
    from kvindex.replay.endpoints import offset_endpoint_port
    from kvindex.sim.engine import SimEngineConfig

    for name in ("engines", "capacity_blocks", "block_size", "buffer_steps"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests < 0 or args.max_tokens < 1:
        raise CliError("--requests must be >= 0 and --max-tokens >= 1")
    if not 0 <= args.http_port_base <= 65535 - args.engines:
        raise CliError("--http-port-base must leave room for one port per engine (0 = ephemeral)")
    engines_dial = not publisher_binds(args.pub)  # kvindex's bind mode (`serve --listen`)
    problem = endpoint_problem(args.pub, dial=engines_dial)
    if problem is not None:
        raise CliError(f"--pub {args.pub!r} {problem}, e.g. tcp://*:5557")
    replay_arg = args.replay if args.replay is not None else default_replay(args.pub)
    replay = None if replay_arg.lower() in ("", "none") else replay_arg
    if replay is not None:
        problem = endpoint_problem(replay, dial=False)
        if not replay.startswith("tcp://"):
            problem = "is not a tcp:// address; expected tcp://HOST:PORT"
        if problem is not None:
            raise CliError(f"--replay {replay!r} {problem}, or 'none'")
    topic_pattern = args.topic if args.topic is not None else ("kv@{pod}@{model}" if engines_dial else "")
    if args.hash_seed is None and args.hash_algo.startswith("xxhash"):
        raise CliError(
            f"{args.hash_algo} with PYTHONHASHSEED unset has a random root per engine: pass --hash-seed "
            "(or set PYTHONHASHSEED) so the indexer can match the hashes"
        )

    configs = []
    for index in range(args.engines):
        pod_id = f"{args.pod_prefix}{index}"
        try:
            # vLLM's data-parallel port rule, reused: port+i, port 0 stays ephemeral.
            pub = args.pub if engines_dial else offset_endpoint_port(args.pub, index)
            replay_endpoint = offset_endpoint_port(replay, index)
        except ValueError as exc:
            raise CliError(f"--pub/--replay: {exc} (use tcp:// endpoints with several engines)") from exc
        try:
            topic = topic_pattern.format(pod=pod_id, model=args.model)
        except (KeyError, IndexError, ValueError) as exc:
            raise CliError(f"--topic may only use the placeholders {{pod}} and {{model}}: {exc}") from exc
        assert pub is not None
        configs.append(
            SimEngineConfig(
                pod_id=pod_id,
                model=args.model,
                block_size=args.block_size,
                capacity_blocks=args.capacity_blocks,
                hash_algo=args.hash_algo,
                hash_seed=args.hash_seed,
                pub_endpoint=pub,
                replay_endpoint=replay_endpoint,
                topic=topic,
                buffer_steps=args.buffer_steps,
                http_host=args.http_host,
                http_port=args.http_port_base + index if args.http_port_base else 0,
            )
        )
    return configs


def default_replay(pub: str) -> str:
    """--replay's default: port DEFAULT_REPLAY_PORT where the engines' PUB is, so a loopback fleet keeps its
    replay sockets on loopback too. Engines that bind (`*`, an address, an interface) bind replay there;
    engines dialling a kvindex on this machine (loopback) bind replay on loopback; dialling another machine,
    on every interface, since that kvindex must reach them. An ephemeral --pub port makes replay's ephemeral."""
    if not pub.startswith("tcp://"):
        return f"tcp://127.0.0.1:{DEFAULT_REPLAY_PORT}"  # ipc:// and inproc:// stay on this machine
    host, _, port = pub[len("tcp://") :].rpartition(";")[2].rpartition(":")
    if (
        not publisher_binds(pub)
        and host.strip("[]") not in ("localhost", "::1")
        and not host.startswith("127.")
    ):
        host = "*"
    return f"tcp://{host}:{port if port in ('0', '*') else DEFAULT_REPLAY_PORT}"


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule (`*`, `::`, ipc, inproc bind), plus: an ephemeral tcp port is always bound."""
    from kvindex.replay.endpoints import should_bind

    return should_bind(endpoint) or (endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0")


def dialable(endpoint: str) -> str:
    """The address a local peer dials for a bound endpoint (`*`, 0.0.0.0 and :: become 127.0.0.1)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint


async def _serve(engines: Sequence[SimEngine], args: argparse.Namespace, out: TextIO) -> int:
    """Start the engines, then run until SIGINT/SIGTERM (or until the --requests workload is done)."""
    import zmq

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Installed before anything is printed, so a signal right after start-up still stops cleanly.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    started: list[SimEngine] = []
    try:
        for engine in engines:
            try:
                await engine.start()
            except (zmq.ZMQError, OSError) as exc:
                raise CliError(
                    f"engine {engine.config.pod_id} cannot open its sockets ({exc}); pick free ports or use port 0"
                ) from exc
            started.append(engine)
        _print_fleet(engines, args, out)
        stopped: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
        work: list[asyncio.Future[object]] = [stopped]
        if args.requests:
            work.append(asyncio.ensure_future(_drive_workload(engines, args, out)))
        done, pending = await asyncio.wait(work, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a workload failure (CliError) surfaces here
        if stopped in done:
            print("kvindex sim: stopping", file=out, flush=True)
        return 0
    finally:
        for engine in started:
            await engine.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _print_fleet(engines: Sequence[SimEngine], args: argparse.Namespace, out: TextIO) -> None:
    """One line per engine, then the `kvindex serve` command line that indexes the whole fleet, in
    `kvindex serve`'s words: engines that bind are dialled with `--pod` (kvindex's connect mode); engines
    that dial are met by `--listen` (kvindex's bind mode), which needs no per-engine flag."""
    connect_mode = publisher_binds(engines[0].config.pub_endpoint)  # kvindex's mode, as serve names it
    pod_flags = []
    for engine in engines:
        config = engine.config
        replay = engine.replay_endpoint
        if connect_mode:
            pod_flag = f"--pod {config.pod_id}={dialable(engine.pub_endpoint)}"
            if replay is not None:
                pod_flag += f",replay={dialable(replay)}"
            pod_flag += f",model={config.model}"
            pod_flags.append(pod_flag)
            mode, hint = "engine binds: kvindex connect mode", f"  serve: {pod_flag}"
        else:
            mode, hint = "engine dials: kvindex bind mode", ""
        print(
            f"{config.pod_id}  http={engine.http_url}  pub={engine.pub_endpoint} ({mode})  "
            f"replay={replay or '-'}  topic={config.topic!r}{hint}",
            file=out,
        )
    common = f"--model {args.model} --block-size {args.block_size} --hash-algo {args.hash_algo}"
    if args.hash_seed is not None:
        common += f" --hash-seed {args.hash_seed}"
    if connect_mode:
        print(f"index them with: kvindex serve {common} {' '.join(pod_flags)}", file=out)
        out.flush()
        return
    listen = _listen_for(engines[0].config.pub_endpoint)
    replays = [engine.replay_endpoint for engine in engines if engine.replay_endpoint is not None]
    # A --listen-replay template names a pod's replay socket by {pod} and {model}: one engine's fixed
    # address works, but not one port per engine on a shared host.
    listen_replay = f" --listen-replay {dialable(replays[0])}" if len(engines) == 1 and replays else ""
    print(f"index them with: kvindex serve --listen {listen}{listen_replay} {common}", file=out)
    if replays and not listen_replay:
        print(
            "  (no --listen-replay: each engine's replay socket has its own port, which a template of {pod} "
            "and {model} cannot name; a lost message waits for the engine's next AllBlocksCleared)",
            file=out,
        )
    out.flush()


def _listen_for(pub: str) -> str:
    """What `kvindex serve --listen` binds for engines dialling `pub`: the same address when it is this
    machine's loopback, else every interface on that port (the address names the indexer's machine)."""
    host, _, port = pub[len("tcp://") :].rpartition(":") if pub.startswith("tcp://") else ("", "", "")
    if not port:
        return pub  # ipc:// and inproc:// are bound as named
    return pub if _is_loopback(host) else f"tcp://*:{port}"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _drive_workload(engines: Sequence[SimEngine], args: argparse.Namespace, out: TextIO) -> None:
    """A few long shared prefixes (system prompts) with short random suffixes, sent to random engines."""
    import aiohttp

    rng = random.Random(args.workload_seed)
    block_size = args.block_size
    prefixes = [[rng.randrange(32_000) for _ in range(rng.randint(4, 8) * block_size)] for _ in range(3)]
    totals = {engine.config.pod_id: [0, 0, 0] for engine in engines}  # requests, prompt, cached tokens
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(args.requests):
            engine = rng.choice(engines)
            prompt = rng.choice(prefixes) + [
                rng.randrange(32_000) for _ in range(rng.randint(1, 2 * block_size))
            ]
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens}
            async with session.post(f"{engine.http_url}/v1/completions", json=body) as response:
                reply = await response.json()
                if response.status != 200:
                    raise CliError(f"{engine.config.pod_id} refused a workload request: {reply.get('error')}")
            row = totals[engine.config.pod_id]
            row[0] += 1
            row[1] += reply["usage"]["prompt_tokens"]
            row[2] += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(
        f"{'pod':<12} {'requests':>8} {'prompt_tok':>10} {'cached_tok':>10} {'hit_rate':>8} {'blocks':>7}",
        file=out,
    )
    for engine in engines:
        requests, prompt_tokens, cached_tokens = totals[engine.config.pod_id]
        hit_rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
        print(
            f"{engine.config.pod_id:<12} {requests:>8} {prompt_tokens:>10} {cached_tokens:>10} "
            f"{hit_rate:>8.1%} {engine.cache.num_cached_blocks:>7}",
            file=out,
        )
    out.flush()
