"""Fault schedules as plain data: which engines exist, then a list of steps (engine, action, arguments,
pause), generated from a seed with per-kind weights. Pure: no sockets, clocks or threads; the driver
(benchmarks/faults/driver.py) performs them and the shrinker (shrink.py) removes steps from them.

One request is one engine step and publishes exactly one batch (every prompt ends in at least one block
of fresh tokens), so batch counts — and with them ring coverage — follow from the steps alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

Mode = Literal["connect", "bind"]
Runner = Literal["inproc", "process"]
Action = Literal[
    "kvindex_start",  # kvindex comes up (steps before it run with no indexer)
    "start",  # a late engine opens its sockets and publishes `n` batches at once
    "requests",  # `n` requests back to back (one batch each)
    "clear",  # reset_prefix_cache: AllBlocksCleared
    "restart",  # a new engine process on the same endpoints: empty cache, seq from 0, then `n` batches
    "stop",  # the engine publishes nothing more, ever (its sockets stay up)
    "disconnect",  # the engine's links (live and replay) are cut for `ms`; `n` batches go out meanwhile
    # (after a restart of the engine, if `restart`)
    "stall",  # kvindex stalls (SIGSTOP, or its worker blocked) for `ms` while `bursts` are published
    "kvindex_restart",  # kvindex dies (kill -9, or abandoned) mid-burst and is back after `ms`
    "quiet",  # nothing happens for `ms` (quiet probes fire)
]
KVINDEX_ACTIONS = frozenset({"kvindex_start", "stall", "kvindex_restart", "quiet"})

# Fault kinds, as the table reports them. A schedule has every kind its data shows (`kinds_of`).
FAULT_KINDS = (
    "late_start",
    "restart_shorter",
    "restart_longer",
    "all_blocks_cleared",
    "stall_burst",
    "ring_gap",
    "stop_publishing",
    "disconnect_return",
    "kvindex_restart",
    "kvindex_kill9",
    "dp_ranks",
    "bind_mode",
    "connect_mode",
)
# Kinds a generator can be asked for (the others follow from the schedule's shape).
STEP_KINDS = (
    "late_start",
    "restart_shorter",
    "restart_longer",
    "all_blocks_cleared",
    "stall_burst",
    "ring_gap",
    "stop_publishing",
    "disconnect_return",
    "kvindex_restart",
)
DEFAULT_WEIGHTS: Mapping[str, float] = {kind: 1.0 for kind in STEP_KINDS}

DEFAULT_HWM = 1000  # vLLM's default is 100,000; any value a burst cannot reach behaves the same
DEFAULT_RING = 1000  # buffer_steps; vLLM's default is 10,000


class Burst(msgspec.Struct, frozen=True, array_like=True):
    """`n` batches from `engine` at once; `restart`: a new engine process (same endpoints, seq from 0)
    first — inside the fault's window (while kvindex is stalled or down)."""

    engine: str
    n: int
    seed: int
    restart: bool = False


class Step(msgspec.Struct, frozen=True, omit_defaults=True):
    """One thing that happens. `engine` is None for kvindex-level actions; `pause_ms` is slept after it."""

    action: Action
    engine: str | None = None
    n: int = 0
    seed: int = 0
    ms: int = 0
    bursts: tuple[Burst, ...] = ()
    pause_ms: int = 0
    restart: bool = False  # disconnect only: the engine restarts while its links are cut

    def engines(self) -> list[str]:
        """Every engine this step touches."""
        named = [] if self.engine is None else [self.engine]
        return named + [burst.engine for burst in self.bursts]


class EngineSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """One (pod, dp rank) publisher: a simulated vLLM engine with its own seq and replay ring."""

    name: str  # "<pod>.<rank>", e.g. "p1.0"
    pod: str
    rank: int = 0
    hwm: int = DEFAULT_HWM  # the PUB socket's SNDHWM (vLLM's KVEventsConfig.hwm)
    ring: int = DEFAULT_RING  # buffer_steps: batches the replay ROUTER keeps
    capacity_blocks: int = 32


class Schedule(msgspec.Struct, frozen=True, omit_defaults=True):
    seed: int
    mode: Mode
    runner: Runner
    engines: tuple[EngineSpec, ...]
    steps: tuple[Step, ...]
    prefix_seed: int = 0  # the shared system prompts every engine's requests draw on
    # Connect mode, in process: a `kvindex sidecar` per pod between its engines and kvindex (kvindex
    # dials the sidecar's sockets and loads its snapshots); the sidecar's ring and PUB high-water mark
    # are SIDECAR_RING and the engine's, so kvindex's own gaps outgrow the sidecar's ring.
    sidecars: bool = False

    def engine(self, name: str) -> EngineSpec:
        return next(spec for spec in self.engines if spec.name == name)

    def without_steps(self, drop: Iterable[int]) -> Schedule:
        dropped = set(drop)
        steps = tuple(step for i, step in enumerate(self.steps) if i not in dropped)
        return msgspec.structs.replace(self, steps=steps)


def removable_steps(schedule: Schedule) -> list[int]:
    """Indexes of the steps the shrinker may drop (everything but kvindex coming up)."""
    return [i for i, step in enumerate(schedule.steps) if step.action != "kvindex_start"]


# --- what a schedule contains ------------------------------------------------------------------


def late_engines(schedule: Schedule) -> set[str]:
    """Engines that open at a `start` step instead of before the first step."""
    return {step.engine for step in schedule.steps if step.action == "start" and step.engine is not None}


def disconnecting_engines(schedule: Schedule) -> set[str]:
    return {step.engine for step in schedule.steps if step.action == "disconnect" and step.engine is not None}


def batch_counts(schedule: Schedule) -> dict[str, list[int]]:
    """Per engine, the batches each incarnation publishes (one entry per process, in order)."""
    return _walk(schedule)[0]


def _walk(schedule: Schedule) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Batches per incarnation, and (old, new) incarnation sizes of every restart that takes effect.

    Mirrors the driver: steps of an engine not yet started (late) or already stopped do nothing.
    """
    late = late_engines(schedule)
    counts: dict[str, list[int]] = {spec.name: [0] for spec in schedule.engines}
    opened = {spec.name: spec.name not in late for spec in schedule.engines}
    stopped: set[str] = set()
    restarts: list[tuple[str, int]] = []  # (engine, index of the new incarnation)

    def active(name: str) -> bool:
        return opened[name] and name not in stopped

    def add(name: str, n: int) -> None:
        if active(name):
            counts[name][-1] += n

    def new_incarnation(name: str) -> None:
        counts[name].append(0)
        restarts.append((name, len(counts[name]) - 1))

    for step in schedule.steps:
        name = step.engine
        if name is not None:
            if step.action == "start" and not opened[name]:
                opened[name] = True
                add(name, step.n)
            elif step.action == "disconnect" and step.restart and active(name):
                new_incarnation(name)
                add(name, step.n)
            elif step.action in ("requests", "disconnect"):
                add(name, step.n)
            elif step.action == "clear":
                add(name, 1)
            elif step.action == "restart" and active(name):
                new_incarnation(name)
                add(name, step.n)
            elif step.action == "stop":
                stopped.add(name)
        for burst in step.bursts:
            # kvindex_restart: the first half goes out before kvindex dies, the engine restarts after.
            before = (burst.n + 1) // 2 if step.action == "kvindex_restart" else 0
            add(burst.engine, before)
            if burst.restart and active(burst.engine):
                new_incarnation(burst.engine)
            add(burst.engine, burst.n - before)
    sizes = [(counts[name][index - 1], counts[name][index]) for name, index in restarts]
    return counts, sizes


def kinds_of(schedule: Schedule) -> set[str]:
    """The fault kinds this schedule exercises (what the table counts it under)."""
    kinds = {f"{schedule.mode}_mode"}
    if any(spec.rank > 0 for spec in schedule.engines):
        kinds.add("dp_ranks")
    for old, new in _walk(schedule)[1]:
        kinds.add("restart_shorter" if new <= old else "restart_longer")
    for step in schedule.steps:
        action = step.action
        if action == "start":
            kinds.add("late_start")
        elif action == "clear":
            kinds.add("all_blocks_cleared")
        elif action == "stop":
            kinds.add("stop_publishing")
        elif action == "disconnect":
            kinds.add("disconnect_return")
        elif action == "stall":
            kinds.add("stall_burst")
        elif action == "kvindex_restart":
            kinds.add("kvindex_kill9" if schedule.runner == "process" else "kvindex_restart")
        # A window kvindex misses that is longer than the engine's ring.
        window: list[tuple[str, int]] = [(burst.engine, burst.n) for burst in step.bursts]
        if action == "disconnect" and step.engine is not None:
            window.append((step.engine, step.n))
        if any(n > schedule.engine(name).ring for name, n in window):
            kinds.add("ring_gap")
    return kinds


# --- generation --------------------------------------------------------------------------------


class GenerateOptions(msgspec.Struct, frozen=True):
    """Size and mix of generated schedules."""

    weights: Mapping[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    process_share: float = 0.1  # schedules run against a `kvindex serve` subprocess (kill -9, SIGSTOP)
    bind_share: float = 0.5
    dp_share: float = 0.3  # schedules with a pod of two DP ranks
    max_pods: int = 3
    min_faults: int = 2
    max_faults: int = 4


DEFAULT_OPTIONS = GenerateOptions()


class _Builder:
    """Appends steps for the engines that can still act (started, not stopped)."""

    def __init__(self, rng: random.Random, engines: list[EngineSpec]) -> None:
        self.rng = rng
        self.engines = engines
        self.steps: list[Step] = []
        self.stopped: set[str] = set()
        self.late: set[str] = set()
        self.started: set[str] = set()

    def live_engines(self) -> list[str]:
        return [
            spec.name
            for spec in self.engines
            if spec.name not in self.stopped and (spec.name not in self.late or spec.name in self.started)
        ]

    def pick(self) -> str | None:
        names = self.live_engines()
        return self.rng.choice(names) if names else None

    def seed(self) -> int:
        return self.rng.randrange(1 << 30)

    def pause(self) -> int:
        # Mostly back to back; sometimes long enough for a quiet probe to fire in between.
        roll = self.rng.random()
        if roll < 0.65:
            return self.rng.choice((0, 0, 10, 20, 40))
        if roll < 0.92:
            return self.rng.randrange(50, 150)
        return self.rng.randrange(350, 550)

    def add(self, step: Step) -> None:
        self.steps.append(step)

    def batches(self, name: str) -> int:
        """Batches the engine's current incarnation has published so far (as the driver will run it)."""
        so_far = Schedule(
            seed=0, mode="connect", runner="inproc", engines=tuple(self.engines), steps=tuple(self.steps)
        )
        return batch_counts(so_far)[name][-1]

    def traffic(self, max_steps: int = 3) -> None:
        for _ in range(self.rng.randint(0, max_steps)):
            name = self.pick()
            if name is not None:
                self.add(
                    Step("requests", name, n=self.rng.randint(1, 12), seed=self.seed(), pause_ms=self.pause())
                )

    def bursts(
        self, names: Sequence[str], low: int, high: int, restart_share: float = 0.0
    ) -> tuple[Burst, ...]:
        """One burst per engine; with probability `restart_share` one of them restarts first."""
        restarting = self.rng.choice(names) if names and self.rng.random() < restart_share else None
        return tuple(
            Burst(name, self.rng.randint(low, high), self.seed(), restart=name == restarting)
            for name in names
        )


def generate(seed: int, options: GenerateOptions = DEFAULT_OPTIONS) -> Schedule:
    """A schedule from `seed`: a few engines, a few dozen steps, 2-4 faults drawn by `options.weights`."""
    rng = random.Random(seed)
    mode: Mode = "bind" if rng.random() < options.bind_share else "connect"
    runner: Runner = "process" if rng.random() < options.process_share else "inproc"
    num_pods = rng.randint(1, options.max_pods)
    dp_pod = rng.randrange(num_pods) if rng.random() < options.dp_share else None
    engines: list[EngineSpec] = []
    for pod_index in range(num_pods):
        for rank in range(2 if pod_index == dp_pod else 1):
            pod = f"p{pod_index}"
            engines.append(
                EngineSpec(f"{pod}.{rank}", pod, rank, capacity_blocks=rng.choice((16, 24, 32, 48)))
            )
    build = _Builder(rng, engines)
    kinds = [kind for kind in STEP_KINDS if options.weights.get(kind, 0.0) > 0]
    weights = [options.weights[kind] for kind in kinds]
    faults = (
        rng.choices(kinds, weights, k=rng.randint(options.min_faults, options.max_faults)) if kinds else []
    )

    # Late engines are chosen first: they publish nothing before their `start` step.
    if "late_start" in faults and len(engines) > 1:
        build.late = {rng.choice(engines).name}
    # Some traffic before kvindex exists: it only reaches kvindex through the rings.
    if rng.random() < 0.5:
        build.traffic(2)
    start_pause = build.pause()
    if mode == "bind":  # engines redial kvindex: batches before its subscription reaches them are lost
        start_pause = max(start_pause, rng.randrange(500, 600))
    build.add(Step("kvindex_start", pause_ms=start_pause))
    build.traffic()
    for late in sorted(build.late):
        if "late_start" not in faults:
            break
        faults.remove("late_start")
        if rng.random() < 0.3:  # long after kvindex came up: its join replay has timed out by now
            build.add(Step("quiet", ms=rng.randrange(2200, 3000)))
        build.add(Step("start", late, n=rng.randint(1, 60), seed=build.seed(), pause_ms=build.pause()))
        build.started.add(late)
        build.traffic()
    tiny_hwm: set[str] = set()
    small_ring: dict[str, int] = {}
    for fault in faults:
        name = build.pick()
        if name is None:
            break
        _add_fault(build, fault, name, tiny_hwm, small_ring)
        build.traffic()
    if rng.random() < 0.3:
        build.add(Step("quiet", ms=rng.randrange(100, 500)))
    specs = [
        msgspec.structs.replace(
            spec,
            hwm=rng.randint(1, 4) if spec.name in tiny_hwm else spec.hwm,
            ring=small_ring.get(spec.name, spec.ring),
        )
        for spec in engines
    ]
    return Schedule(
        seed=seed,
        mode=mode,
        runner=runner,
        engines=tuple(specs),
        steps=tuple(build.steps),
        prefix_seed=rng.randrange(1 << 30),
    )


def _add_fault(
    build: _Builder, fault: str, name: str, tiny_hwm: set[str], small_ring: dict[str, int]
) -> None:
    rng = build.rng
    if fault == "late_start":  # a single-engine schedule (no late engine): the engine starts late instead
        fault = "restart_longer"
    if fault in ("restart_shorter", "restart_longer"):
        before = build.batches(name)
        if fault == "restart_shorter" and before >= 2:
            n = rng.randint(1, before - 1)
        else:
            n = before + rng.randint(1, 20)
        build.add(Step("restart", name, n=n, seed=build.seed(), pause_ms=build.pause()))
    elif fault == "all_blocks_cleared":
        build.add(Step("clear", name, pause_ms=build.pause()))
    elif fault == "stall_burst":
        names = rng.sample(build.live_engines(), rng.randint(1, len(build.live_engines())))
        tiny_hwm.update(name for name in names if rng.random() < 0.8)
        build.add(
            Step(
                "stall",
                ms=rng.randrange(100, 500),
                bursts=build.bursts(names, 10, 150, restart_share=0.25),
                pause_ms=build.pause(),
            )
        )
    elif fault == "ring_gap":
        ring = rng.randint(3, 8)
        small_ring[name] = min(ring, small_ring.get(name, ring))
        tiny_hwm.add(name)
        n = ring + rng.randint(2, 40)
        build.add(
            Step(
                "stall",
                ms=rng.randrange(100, 400),
                bursts=(Burst(name, n, build.seed()),),
                pause_ms=build.pause(),
            )
        )
        if rng.random() < 0.4:  # the engine's own reset makes its whole cache known again
            build.add(Step("clear", name, pause_ms=build.pause()))
    elif fault == "stop_publishing":
        if rng.random() < 0.7:  # the last batches are lost (tiny HWM during a stall), then silence
            tiny_hwm.add(name)
            build.add(Step("stall", ms=rng.randrange(100, 400), bursts=build.bursts([name], 5, 60)))
        build.add(Step("stop", name, pause_ms=build.pause()))
        build.stopped.add(name)
    elif fault == "disconnect_return":
        build.add(
            Step(
                "disconnect",
                name,
                n=rng.randint(0, 30),
                seed=build.seed(),
                ms=rng.randrange(100, 600),
                pause_ms=build.pause(),
                restart=rng.random() < 0.2,
            )
        )
    elif fault == "kvindex_restart":
        names = rng.sample(build.live_engines(), rng.randint(1, len(build.live_engines())))
        build.add(
            Step(
                "kvindex_restart",
                ms=rng.randrange(0, 400),
                bursts=build.bursts(names, 4, 80, restart_share=0.25),
                pause_ms=build.pause(),
            )
        )


# --- reading ------------------------------------------------------------------------------------


def describe_engine(spec: EngineSpec) -> str:
    extras = []
    if spec.hwm != DEFAULT_HWM:
        extras.append(f"hwm {spec.hwm}")
    if spec.ring != DEFAULT_RING:
        extras.append(f"ring {spec.ring}")
    extras.append(f"{spec.capacity_blocks} blocks")
    return f"{spec.name} ({', '.join(extras)})"


def describe_step(step: Step) -> str:
    parts = [step.action.ljust(15), (step.engine or "-").ljust(6)]
    if step.action in ("start", "requests", "restart", "disconnect"):
        parts.append(f"n={step.n}")
    if step.ms:
        parts.append(f"for {step.ms}ms")
    if step.restart:
        parts.append("(engine restarts while cut)")
    if step.bursts:
        bursts = [f"{b.engine}{' restarts, then' if b.restart else ''}x{b.n}" for b in step.bursts]
        parts.append("bursts " + " ".join(bursts))
    if step.pause_ms:
        parts.append(f"then {step.pause_ms}ms")
    return "  ".join(parts).rstrip()


def format_schedule(schedule: Schedule) -> str:
    """Readable: one header line, one line per step."""
    runner = "kvindex serve subprocess" if schedule.runner == "process" else "in-process kvindex"
    header = f"seed {schedule.seed}: {schedule.mode} mode, {runner}; engines " + ", ".join(
        describe_engine(spec) for spec in schedule.engines
    )
    lines = [header]
    lines += [f"  {i:>3}  {describe_step(step)}" for i, step in enumerate(schedule.steps)]
    return "\n".join(lines)


def to_json(schedule: Schedule) -> str:
    return msgspec.json.encode(schedule).decode()


def from_json(text: str | bytes) -> Schedule:
    return msgspec.json.decode(text, type=Schedule)
