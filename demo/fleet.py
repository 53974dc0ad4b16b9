"""`kvindex demo`'s shell: per routing policy, a fresh fleet in this process and the trace routed over it.

Simulated engines (real PUB/replay sockets, real HTTP) -> the real IngestService -> the real HTTP API
on 127.0.0.1 ephemeral ports; with `sidecars`, a kvindex sidecar per engine sits between them (the
indexer dials the sidecars and loads their snapshots). The router sends each request to an engine over HTTP and adds up the
cached tokens the engine reports; the kv-aware policy asks POST /v1/score first, as a real router would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import aiohttp
from aiohttp import web
from kvindex.api.app import create_app
from kvindex.api.settings import ApiSettings
from kvindex.api.site import ApiSite
from kvindex.demo.policies import POLICY_NAMES, RoutingPolicy, make_policy
from kvindex.demo.report import PolicyResult, ProgressLine
from kvindex.demo.workload import DemoRequest
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.sidecar.http import HttpThread
from kvindex.sidecar.service import SidecarService
from kvindex.sidecar.settings import SidecarSettings
from kvindex.sim.engine import SimEngine, SimEngineConfig

MODEL = "demo-model"
BLOCK_SIZE = 16
HASH_ALGO = "sha256"
HASH_SEED = "0"  # engines and indexer agree on it, as PYTHONHASHSEED must in a real fleet
STARTUP_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DemoOptions:
    num_pods: int
    num_requests: int
    seed: int
    capacity_blocks: int
    concurrency: int
    duration_s: float | None
    index_wait_ms: float
    sidecars: bool = False  # a kvindex sidecar per engine, between it and the indexer


class DemoError(Exception):
    """The demo could not run (a part failed to start or answer); one sentence for the user."""


async def run_all(trace: Sequence[DemoRequest], options: DemoOptions, progress: TextIO) -> list[PolicyResult]:
    results: list[PolicyResult] = []
    budget_s = None if options.duration_s is None else options.duration_s / len(POLICY_NAMES)
    for policy_name in POLICY_NAMES:
        # Every policy routes the same requests: if the first one was cut short by --duration, the
        # others replay exactly the prefix it got through.
        policy_trace = trace if not results else trace[: results[0].requests]
        policy = make_policy(policy_name, options.seed)
        results.append(await _run_policy(policy, policy_trace, options, budget_s, progress))
    return results


class _Fleet:
    """One policy's world: simulated engines, the ingest service and the HTTP API, all fresh."""

    def __init__(self, options: DemoOptions) -> None:
        self.pod_ids = [f"pod-{chr(ord('a') + n)}" if n < 26 else f"pod-{n}" for n in range(options.num_pods)]
        self.engines: list[SimEngine] = []
        self.sidecars: list[tuple[SidecarService, HttpThread]] = []
        self.service: IngestService | None = None
        self.runner: web.AppRunner | None = None
        self.api_url = ""
        self._options = options

    async def start(self) -> None:
        for pod_id in self.pod_ids:
            engine = _make_engine(pod_id, self._options)
            self.engines.append(engine)
            await engine.start()
        model = ModelConfig(name=MODEL, block_size=BLOCK_SIZE, hash_algo=HASH_ALGO, hash_seed=HASH_SEED)
        pods = [
            PodConfig(
                pod_id=pod_id,
                endpoint=engine.pub_endpoint,
                model=MODEL,
                replay_endpoint=engine.replay_endpoint,
            )
            for pod_id, engine in zip(self.pod_ids, self.engines, strict=True)
        ]
        if self._options.sidecars:
            pods = await asyncio.get_running_loop().run_in_executor(None, self._start_sidecars, pods, model)
        self.service = IngestService([model], pods, settings=IngestSettings(num_workers=2))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.service.start)
        self.runner = web.AppRunner(create_app(self.service, ApiSettings(host="127.0.0.1", port=0)))
        await self.runner.setup()
        site = ApiSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.api_url = f"http://{host}:{port}"
        await _await_condition(self.service.ready, STARTUP_TIMEOUT_S, "the indexer did not become ready")

    def _start_sidecars(self, engine_pods: list[PodConfig], model: ModelConfig) -> list[PodConfig]:
        """A sidecar per engine (ephemeral loopback ports); the indexer's pods become the sidecars'."""
        pods = []
        for pod in engine_pods:
            settings = SidecarSettings(
                pod_id=pod.pod_id,
                model=model,
                engines=(pod.endpoint,),
                engine_replays=(pod.replay_endpoint,),
                publish="tcp://127.0.0.1:0",
                replay="tcp://127.0.0.1:0",
                http_host="127.0.0.1",
                http_port=0,
            )
            sidecar = SidecarService(settings)
            http = HttpThread(sidecar)
            self.sidecars.append((sidecar, http))
            sidecar.start()
            url = http.start()
            publisher = sidecar.publishers[0]
            pods.append(
                PodConfig(
                    pod.pod_id,
                    publisher.endpoint,
                    MODEL,
                    replay_endpoint=publisher.replay_endpoint,
                    snapshot_url=f"{url}/v1/snapshot",
                )
            )
        return pods

    def _stop_sidecars(self) -> None:
        for sidecar, http in self.sidecars:
            http.stop()
            sidecar.stop()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.service is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.service.stop)
        await asyncio.get_running_loop().run_in_executor(None, self._stop_sidecars)
        for engine in self.engines:
            await engine.stop()

    def events_indexed(self) -> int:
        assert self.service is not None
        return sum(self.service.counters().events_applied.values())

    def indexer_caught_up(self) -> bool:
        """Has the indexer applied every batch the engines have published so far?"""
        assert self.service is not None
        applied = {status.pod: status.last_seq for status in self.service.pod_statuses()}
        for n, (pod_id, engine) in enumerate(zip(self.pod_ids, self.engines, strict=True)):
            published = _last_published_seq(engine)
            if published is None:
                continue
            if self.sidecars:
                # The indexer follows the sidecar's seq: every engine batch relayed, then applied.
                sidecar = self.sidecars[n][0]
                if sidecar.ingest.applied_seqs().get(PodRef(pod_id, 0)) != published:
                    return False
                published = sidecar.relay.downstream_seq(0)
                if published is None:
                    return False
            last_applied = applied.get(pod_id)
            if last_applied is None or last_applied < published:
                return False
        return True


async def _await_condition(condition: Callable[[], bool], timeout_s: float, failure: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise DemoError(failure)
        await asyncio.sleep(0.01)  # ok: polling with a deadline


async def _run_policy(
    policy: RoutingPolicy,
    trace: Sequence[DemoRequest],
    options: DemoOptions,
    budget_s: float | None,
    progress_stream: TextIO,
) -> PolicyResult:
    result = PolicyResult(policy=policy.name)
    fleet = _Fleet(options)
    try:
        await fleet.start()
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await _route_trace(session, fleet, policy, trace, options, budget_s, result, progress_stream)
        # The last requests' events are in flight: let them land before counting (bounded).
        await _settle(fleet)
        result.events_indexed = fleet.events_indexed()
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        raise DemoError(
            f"{policy.name}: a simulated engine or the indexer stopped answering ({exc!r})"
        ) from exc
    finally:
        await fleet.stop()
    return result


async def _settle(fleet: _Fleet) -> None:
    deadline = time.monotonic() + 2.0
    while not fleet.indexer_caught_up() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # ok: polling with a deadline


async def _route_trace(
    session: aiohttp.ClientSession,
    fleet: _Fleet,
    policy: RoutingPolicy,
    trace: Sequence[DemoRequest],
    options: DemoOptions,
    budget_s: float | None,
    result: PolicyResult,
    progress_stream: TextIO,
) -> None:
    """Send the trace in order, at most `options.concurrency` in flight; a conversation's next turn
    waits for its previous turn's reply. Routing decisions are taken one at a time, in trace order."""
    progress = ProgressLine(progress_stream, policy.name, len(trace))
    finished = [asyncio.Event() for _ in trace]
    slots = asyncio.Semaphore(options.concurrency)
    outstanding = dict.fromkeys(fleet.pod_ids, 0)
    engine_urls = {
        pod_id: engine.http_url for pod_id, engine in zip(fleet.pod_ids, fleet.engines, strict=True)
    }
    in_flight: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []
    num_done = 0
    started = time.monotonic()

    async def send(request: DemoRequest, pod_id: str) -> None:
        nonlocal num_done
        try:
            payload = {"model": MODEL, "prompt": list(request.token_ids), "max_tokens": request.max_tokens}
            async with session.post(f"{engine_urls[pod_id]}/v1/completions", json=payload) as response:
                if response.status != 200:
                    result.errors += 1
                    return
                body = await response.json()
            usage = body["usage"]
            result.prompt_tokens += int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens += int(details.get("cached_tokens") or 0)
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as exc:
            failures.append(exc)
        finally:
            outstanding[pod_id] -= 1
            finished[request.index].set()
            slots.release()
            num_done += 1
            result.events_indexed = fleet.events_indexed()
            progress.update(num_done, result)

    for request in trace:
        if budget_s is not None and time.monotonic() - started > budget_s:
            break
        if failures:
            break
        if request.after is not None:
            await finished[request.after].wait()
        await slots.acquire()
        scores: dict[str, float] = {}
        if policy.needs_scores:
            scores = await _score(session, fleet, request, options, result)
        pod_id = policy.choose(fleet.pod_ids, scores, outstanding)
        outstanding[pod_id] += 1
        result.requests += 1
        result.requests_per_pod[pod_id] = result.requests_per_pod.get(pod_id, 0) + 1
        task = asyncio.create_task(send(request, pod_id))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)
    result.elapsed_s = time.monotonic() - started
    result.events_indexed = fleet.events_indexed()
    progress.finish(num_done, result)
    if failures:
        raise DemoError(f"{policy.name}: a request to a simulated engine failed ({failures[0]!r})")
    if result.errors:
        raise DemoError(f"{policy.name}: {result.errors} requests were refused by the simulated engines")


async def _score(
    session: aiohttp.ClientSession,
    fleet: _Fleet,
    request: DemoRequest,
    options: DemoOptions,
    result: PolicyResult,
) -> dict[str, float]:
    """Ask kvindex over HTTP, as a router would. The indexer is asynchronous: give it at most
    `index_wait_ms` to apply what the engines already published, and count the scores taken stale."""
    deadline = time.monotonic() + options.index_wait_ms / 1000.0
    while not fleet.indexer_caught_up():
        if time.monotonic() >= deadline:
            result.stale_scores += 1
            break
        await asyncio.sleep(0.001)  # ok: bounded wait, polled
    payload = {"model": MODEL, "token_ids": list(request.token_ids)}
    sent = time.perf_counter()
    async with session.post(f"{fleet.api_url}/v1/score", json=payload) as response:
        body = await response.json()
        if response.status != 200:
            raise DemoError(f"POST /v1/score answered {response.status}: {body.get('error')}")
    result.score_latencies_ms.append((time.perf_counter() - sent) * 1000.0)
    return {entry["pod"]: float(entry["score"]) for entry in body["scores"]}


# --- the simulated engine seam ---------------------------------------------------------------------


def _make_engine(pod_id: str, options: DemoOptions) -> SimEngine:
    return SimEngine(
        SimEngineConfig(
            pod_id=pod_id,
            model=MODEL,
            block_size=BLOCK_SIZE,
            capacity_blocks=options.capacity_blocks,
            hash_algo=HASH_ALGO,
            hash_seed=HASH_SEED,
            pub_endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
            http_host="127.0.0.1",
            http_port=0,
        )
    )


def _last_published_seq(engine: SimEngine) -> int | None:
    """The seq of the engine's latest batch: the publisher numbers batches 0, 1, 2, ..."""
    return engine.num_batches_published - 1 if engine.num_batches_published else None
