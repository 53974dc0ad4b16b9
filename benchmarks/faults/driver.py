"""Fault harness, the driver: runs one schedule over real ZMQ on 127.0.0.1 — simulated engines, links
that can be cut, kvindex in process or as a subprocess — and at quiescence judges kvindex pod by pod
against each engine's own cache.

Quiescence: every engine's publisher drained, then `quiet_probe_after_s` plus one probe round, then
kvindex is read until its verdict holds still (or is exact twice), or a deadline passes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import random
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import msgspec
from kvindex.indexer.model import PodConfig

from benchmarks.faults.engines import (
    LOOPBACK,
    FaultEngine,
    LinkProxy,
    PortPool,
    make_hasher,
    prefix_pool,
    tcp,
)
from benchmarks.faults.schedule import Schedule, Step, describe_step, disconnecting_engines, late_engines
from benchmarks.faults.subject import (
    MODEL,
    HarnessKnobs,
    InprocSubject,
    PodKey,
    PodView,
    ProcessSubject,
    Subject,
    ingest_settings,
    model_config,
    serve_config,
)
from benchmarks.faults.verdict import PodVerdict, is_failure, judge, worst

# Bind mode: how long after a link comes up (kvindex listening, the engine's PUB dialling, a cut link
# restored) a batch can still be lost because kvindex's subscription has not reached the PUB yet.
# vLLM's PUB redials every 100 ms (ZMQ's default reconnect interval).
SUBSCRIPTION_GRACE_S = 0.5


class QuiesceSettings(msgspec.Struct, frozen=True):
    probe_round_s: float = 0.4  # the watch thread's tick plus one replay on loopback
    poll_s: float = 0.1
    # A verdict that is not exact is final once it has not changed for this long beyond kvindex's own
    # waits: a replay's idle timeout (a reply lost with a cut link) and the SUB's reconnect backoff cap.
    settle_s: float = 1.0
    exact_confirm_s: float = 0.2  # an exact verdict is final once it still holds this much later
    extra_deadline_s: float = 6.0  # beyond the settle time: then the verdict stands, changing or not


DEFAULT_QUIESCE = QuiesceSettings()
DEFAULT_KNOBS = HarnessKnobs()


class Outcome(msgspec.Struct, frozen=True):
    schedule: Schedule
    outcome: str  # exact | flagged | flagged_needlessly | divergent | error
    pods: tuple[PodVerdict, ...]
    seconds: float
    notes: tuple[str, ...] = ()
    error: str | None = None

    def describe(self) -> str:
        lines = [f"seed {self.schedule.seed}: {self.outcome} ({self.seconds:.1f} s)"]
        lines += [f"  {verdict.describe()}" for verdict in self.pods]
        lines += [f"  note: {note}" for note in self.notes]
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)


# The sidecars' downstream ring (batches per rank): small, so kvindex's gaps outgrow it and its
# recoveries go through the sidecar's snapshot.
SIDECAR_RING = 8


class _Run:
    """Everything one schedule owns while it runs."""

    def __init__(self, schedule: Schedule, knobs: HarnessKnobs, stack: ExitStack) -> None:
        self.schedule = schedule
        self.knobs = knobs
        self.notes: list[str] = []
        self.sidecars: list[object] = []  # SidecarService, imported only when a schedule has sidecars
        bind_mode = schedule.mode == "bind"
        ports = PortPool(random.Random())
        stack.callback(ports.close)  # last: every socket on these ports is closed by then
        hasher = make_hasher()
        prefixes = prefix_pool(schedule.prefix_seed)
        cut = disconnecting_engines(schedule)
        ranks_by_pod: dict[str, int] = {}
        for spec in schedule.engines:
            ranks_by_pod[spec.pod] = max(ranks_by_pod.get(spec.pod, 0), spec.rank + 1)
        max_ranks = max(ranks_by_pod.values(), default=1)
        # Bind mode: engines dial kvindex (rank r at listen port + r), and kvindex reaches a pod's replay
        # socket through the template tcp://{pod} (+ r): the pod id is its replay base address.
        self.listen_replay = "tcp://{pod}" if bind_mode else None
        listen_base = ports.run(max_ranks) if bind_mode else 0
        self.listen = [tcp(listen_base + r) for r in range(max_ranks)] if bind_mode else []
        pub_base = {pod: ports.run(n) for pod, n in ranks_by_pod.items()}
        replay_base = {pod: ports.run(n) for pod, n in ranks_by_pod.items()}
        self.engines: dict[str, FaultEngine] = {}
        self.pod_keys: dict[str, PodKey] = {}
        self.proxies: dict[str, list[LinkProxy]] = {}
        pods: list[PodConfig] = []
        for spec in schedule.engines:
            r = spec.rank
            if bind_mode:
                pod_id = f"{LOOPBACK}:{replay_base[spec.pod]}"
                pub_port, replay_port = listen_base + r, replay_base[spec.pod] + r
                if spec.name in cut:
                    # kvindex <- live proxy <- engine's PUB; kvindex -> replay proxy (where kvindex looks
                    # for the pod's replay socket) -> the engine's ROUTER.
                    live = LinkProxy(ports.run(1), listen_base + r)
                    replay = LinkProxy(replay_port, ports.run(1))
                    self.proxies[spec.name] = [live, replay]
                    pub_port, replay_port = live.port, replay.target_port
                engine = FaultEngine(
                    spec,
                    # Base endpoints: the publisher adds the DP rank, as vLLM does.
                    pub_base=tcp(pub_port - r),
                    replay_base=tcp(replay_port - r),
                    bind_pub=None,  # vLLM's rule: a named host is dialled
                    topic=f"kv@{pod_id}@{MODEL}",
                    prefixes=prefixes,
                    hasher=hasher,
                )
            else:
                pod_id = spec.pod
                pub_endpoint, replay_endpoint = tcp(pub_base[spec.pod] + r), tcp(replay_base[spec.pod] + r)
                if spec.name in cut:
                    live = LinkProxy(ports.run(1), pub_base[spec.pod] + r)
                    replay = LinkProxy(ports.run(1), replay_base[spec.pod] + r)
                    self.proxies[spec.name] = [live, replay]
                    pub_endpoint, replay_endpoint = live.endpoint, replay.endpoint
                pods.append(
                    PodConfig(pod_id, pub_endpoint, MODEL, replay_endpoint=replay_endpoint, dp_rank=r)
                )
                engine = FaultEngine(
                    spec,
                    pub_base=tcp(pub_base[spec.pod]),
                    replay_base=tcp(replay_base[spec.pod]),
                    bind_pub=True,  # a fixed loopback port kvindex dials, the same after a restart
                    topic="",
                    prefixes=prefixes,
                    hasher=hasher,
                )
            stack.callback(engine.close)
            self.engines[spec.name] = engine
            self.pod_keys[spec.name] = (pod_id, r)
        for links in self.proxies.values():
            for link in links:
                stack.callback(link.close)
        if schedule.sidecars:
            if bind_mode or schedule.runner != "inproc":
                raise ValueError("sidecars run in connect mode with the in-process kvindex only")
            pods = self._start_sidecars(pods, ports, knobs, stack)
        self.subject: Subject
        if schedule.runner == "process":
            self.subject = ProcessSubject(serve_config(pods, self.listen, self.listen_replay, knobs))
        else:
            settings = ingest_settings(knobs, listen_replay=self.listen_replay)
            self.subject = InprocSubject(pods, self.listen, settings)
        stack.callback(self.subject.close)
        self.kvindex_up = False
        self.kvindex_up_at = 0.0
        self.link_up_at: dict[str, float] = {}

    def _start_sidecars(
        self, engine_pods: list[PodConfig], ports: PortPool, knobs: HarnessKnobs, stack: ExitStack
    ) -> list[PodConfig]:
        """A sidecar per pod dialling its engines (through their cut links, if any); kvindex's pods
        become the sidecars' downstream sockets and snapshot URLs."""
        from kvindex.sidecar.http import HttpThread
        from kvindex.sidecar.service import SidecarService
        from kvindex.sidecar.settings import SidecarSettings

        by_pod: dict[str, list[PodConfig]] = {}
        for pod in engine_pods:
            by_pod.setdefault(pod.pod_id, []).append(pod)
        hwm = {spec.pod: spec.hwm for spec in self.schedule.engines}
        central: list[PodConfig] = []
        for pod_id, ranks in by_pod.items():
            ranks.sort(key=lambda p: p.dp_rank)
            publish_base, replay_base = ports.run(len(ranks)), ports.run(len(ranks))
            settings = SidecarSettings(
                pod_id=pod_id,
                model=model_config(),
                engines=tuple(p.endpoint for p in ranks),
                engine_replays=tuple(p.replay_endpoint for p in ranks),
                publish=tcp(publish_base),
                replay=tcp(replay_base),
                publish_bind=True,
                buffer_steps=SIDECAR_RING,
                hwm=hwm[pod_id],
                quiet_probe_after_s=knobs.quiet_probe_after_s,
                replay_timeout_s=knobs.replay_timeout_s,
                reconnect_ivl_max_ms=knobs.reconnect_ivl_max_ms,
            )
            sidecar = SidecarService(settings)
            stack.callback(sidecar.stop)
            sidecar.start()
            http = HttpThread(sidecar)
            stack.callback(http.stop)
            url = http.start()
            self.sidecars.append(sidecar)
            for pod in ranks:
                r = pod.dp_rank
                central.append(
                    PodConfig(
                        pod_id,
                        tcp(publish_base + r),
                        MODEL,
                        replay_endpoint=tcp(replay_base + r),
                        dp_rank=r,
                        snapshot_url=f"{url}/v1/snapshot",
                    )
                )
        return central

    # -- steps -------------------------------------------------------------------------------------

    def perform(self, step: Step) -> None:
        engine = self.engines[step.engine] if step.engine is not None else None
        action = step.action
        if action == "kvindex_start":
            self._start_kvindex()
        elif action == "start" and engine is not None:
            if not engine.opened:
                engine.open()
                engine.requests(step.n, step.seed)
        elif action == "requests" and engine is not None:
            engine.requests(step.n, step.seed)
        elif action == "clear" and engine is not None:
            engine.clear()
        elif action == "restart" and engine is not None:
            if engine.active:
                engine.restart()
                engine.requests(step.n, step.seed)
        elif action == "stop" and engine is not None:
            engine.stopped = True
        elif action == "disconnect" and engine is not None:
            links = self.proxies.get(engine.spec.name, [])
            for link in links:
                link.cut()
            if step.restart:
                engine.restart()
            engine.requests(step.n, step.seed)
            engine.flush()
            pace(step.ms)
            for link in links:
                link.restore()
            self.link_up_at[engine.spec.name] = time.monotonic()
        elif action == "stall":
            stalled = self.kvindex_up and self.subject.stall()
            if self.kvindex_up and not stalled:
                self.notes.append(f"{describe_step(step)}: kvindex could not be stalled")
            try:
                self._bursts(step)
                pace(step.ms)
            finally:
                if stalled:
                    self.subject.resume()
        elif action == "kvindex_restart":
            self._bursts(step, half=1)  # the kill lands mid-burst: the first halves are still in flight
            if self.kvindex_up:
                self.subject.crash()
            self._bursts(step, half=2)
            for burst in step.bursts:
                self.engines[burst.engine].flush()
            pace(step.ms)
            if self.kvindex_up:
                self._start_kvindex()
        elif action == "quiet":
            pace(step.ms)

    def _start_kvindex(self) -> None:
        self.subject.start()
        self.kvindex_up = True
        self.kvindex_up_at = time.monotonic()

    def _unseeable(self, name: str) -> bool:
        """Bind mode: no batch of this engine left after its link to kvindex was up for the grace time."""
        if self.schedule.mode != "bind":
            return False
        engine = self.engines[name]
        link_up = max(self.kvindex_up_at, engine.opened_at, self.link_up_at.get(name, 0.0))
        return engine.last_batch_at is None or engine.last_batch_at < link_up + SUBSCRIPTION_GRACE_S

    def _bursts(self, step: Step, half: int = 0) -> None:
        """Each burst at once; `half` 1 / 2: the first / second half of each (0: all of it, drained).
        A restarting burst's engine restarts first (with `half`: between the halves, so while kvindex
        is down)."""
        for burst in step.bursts:
            engine = self.engines[burst.engine]
            first = (burst.n + 1) // 2
            if burst.restart and half != 1:
                engine.restart()
            if half == 0:
                engine.requests(burst.n, burst.seed)
            elif half == 1:
                engine.requests(first, burst.seed)
            else:
                engine.requests(burst.n - first, burst.seed + 1)
        if half == 0:
            for burst in step.bursts:
                self.engines[burst.engine].flush()

    # -- the end -----------------------------------------------------------------------------------

    def verdicts(self, views: dict[PodKey, PodView]) -> list[PodVerdict]:
        result = []
        for name, engine in self.engines.items():
            view = views.get(self.pod_keys[name])
            result.append(
                judge(
                    name,
                    engine.held(),
                    view.claims if view is not None else frozenset(),
                    state=view.state if view is not None else None,
                    partial_view=view.partial_view if view is not None else False,
                    history=engine.history,
                    ring=engine.spec.ring,
                    unseeable=self._unseeable(name),
                )
            )
        return result

    def explain_failure(self, verdicts: list[PodVerdict]) -> None:
        """What kvindex and the harness knew about each failing pod (for the report)."""
        views = self.subject.view(())
        for verdict in verdicts:
            if not is_failure(verdict.outcome):
                continue
            engine = self.engines[verdict.engine]
            view = views.get(self.pod_keys[verdict.engine])
            said = view.detail if view is not None else "not listed"
            self.notes.append(
                f"{verdict.engine}: kvindex says {said}; the engine is incarnation {engine.incarnation}, "
                f"{engine.batches} batches (last seq {engine.batches - 1})"
            )
            self.notes += [link.describe() for link in self.proxies.get(verdict.engine, [])]
        self.notes += self.subject.diagnostics()

    def quiesce(self, settings: QuiesceSettings) -> list[PodVerdict]:
        for engine in self.engines.values():
            engine.flush()
        pace_s(self.knobs.quiet_probe_after_s + settings.probe_round_s)
        settle_s = settings.settle_s + self.knobs.replay_timeout_s + self.subject.reconnect_cap_s
        deadline = time.monotonic() + settle_s + settings.extra_deadline_s
        universe: set[int] = set().union(*(engine.ever for engine in self.engines.values()))
        last: list[PodVerdict] | None = None
        since = time.monotonic()
        while True:
            verdicts = self.verdicts(self.subject.view(universe))
            now = time.monotonic()
            if verdicts != last:
                last, since = verdicts, now
            all_exact = all(v.outcome == "exact" for v in verdicts)
            held_for = now - since
            if (all_exact and held_for >= settings.exact_confirm_s) or held_for >= settle_s:
                return verdicts
            if now > deadline:
                self.notes.append("verdict still changing at the deadline")
                return verdicts
            pace_s(settings.poll_s)


def pace(ms: int) -> None:
    pace_s(ms / 1000)


def pace_s(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)  # ok: schedule pacing (deliberate), not a wait for a condition


def run_schedule(
    schedule: Schedule,
    *,
    knobs: HarnessKnobs = DEFAULT_KNOBS,
    quiesce: QuiesceSettings = DEFAULT_QUIESCE,
    on_step: Callable[[int, Step], None] | None = None,
) -> Outcome:
    """Run `schedule` once and judge kvindex at quiescence. Never raises for a failed run: an exception
    in the harness or in kvindex becomes outcome "error" with its traceback."""
    started = time.monotonic()
    run: _Run | None = None
    try:
        with ExitStack() as stack:
            run = _Run(schedule, knobs, stack)
            late = late_engines(schedule)
            for name, engine in run.engines.items():
                if name not in late:
                    engine.open()
            for index, step in enumerate(schedule.steps):
                if on_step is not None:
                    on_step(index, step)
                run.perform(step)
                pace(step.pause_ms)
            verdicts = run.quiesce(quiesce) if run.kvindex_up else run.verdicts({})
            if is_failure(worst(v.outcome for v in verdicts)):
                run.explain_failure(verdicts)
            return Outcome(
                schedule=schedule,
                outcome=worst(v.outcome for v in verdicts),
                pods=tuple(verdicts),
                seconds=time.monotonic() - started,
                notes=tuple(run.notes),
            )
    except Exception:
        return Outcome(
            schedule=schedule,
            outcome="error",
            pods=(),
            seconds=time.monotonic() - started,
            notes=tuple(run.notes) if run is not None else (),
            error=traceback.format_exc(limit=8),
        )


def quiet_kvindex_logs() -> None:
    """Gaps, replays and restarts are what schedules provoke: kvindex's warnings about them are noise."""
    logging.getLogger("kvindex").setLevel(logging.ERROR)


def run_many(schedules: Sequence[Schedule], *, jobs: int = 1) -> list[Outcome]:
    """Every schedule's outcome, in order; `jobs` > 1 runs that many at once, each in its own process."""
    if jobs <= 1:
        return [run_schedule(schedule) for schedule in schedules]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=context, initializer=quiet_kvindex_logs
    ) as pool:
        return list(pool.map(run_schedule, schedules))
