"""The fault harness itself (benchmarks/faults): schedules are reproducible plain data, their kinds and
batch counts follow from the steps, the verdict follows the rule, the shrinker finds the smallest
failing schedule, the link proxy really cuts, and the command prints its table."""

from __future__ import annotations

import random

import zmq
from bench_support import run_quick

from benchmarks.faults.engines import LinkProxy, PortPool, prompts, tcp
from benchmarks.faults.schedule import (
    STEP_KINDS,
    Burst,
    EngineSpec,
    GenerateOptions,
    Schedule,
    Step,
    batch_counts,
    format_schedule,
    from_json,
    generate,
    kinds_of,
    to_json,
)
from benchmarks.faults.shrink import shrink
from benchmarks.faults.verdict import judge, worst


def one_engine(steps: list[Step], ring: int = 1000) -> Schedule:
    return Schedule(
        seed=1,
        mode="connect",
        runner="inproc",
        engines=(EngineSpec("p0.0", "p0", ring=ring),),
        steps=(Step("kvindex_start"), *steps),
    )


def test_a_seed_always_gives_the_same_schedule_and_json_round_trips() -> None:
    for seed in range(50):
        schedule = generate(seed)
        assert generate(seed) == schedule
        assert from_json(to_json(schedule)) == schedule
        assert [step.action for step in schedule.steps].count("kvindex_start") == 1
    assert len({to_json(generate(seed)) for seed in range(50)}) == 50


def test_generated_schedules_cover_every_kind_and_respect_weights() -> None:
    kinds: set[str] = set()
    for seed in range(300):
        kinds |= kinds_of(generate(seed, GenerateOptions(process_share=0.2)))
    assert kinds >= {*STEP_KINDS, "dp_ranks", "bind_mode", "connect_mode", "kvindex_kill9"}
    only_clears = GenerateOptions(weights={"all_blocks_cleared": 1.0}, process_share=0.0)
    for seed in range(30):
        schedule = generate(seed, only_clears)
        assert {step.action for step in schedule.steps} <= {"kvindex_start", "requests", "clear", "quiet"}


def test_batch_counts_follow_the_steps_per_incarnation() -> None:
    schedule = Schedule(
        seed=1,
        mode="connect",
        runner="inproc",
        engines=(EngineSpec("a.0", "a"), EngineSpec("b.0", "b")),
        steps=(
            Step("requests", "a.0", n=5),
            Step("kvindex_start"),
            Step("requests", "b.0", n=3),  # b.0 starts late: nothing happens yet
            Step("start", "b.0", n=4),
            Step("clear", "a.0"),
            Step("restart", "a.0", n=2),
            Step("stall", bursts=(Burst("a.0", 7, 1), Burst("b.0", 1, 2))),
            Step("stop", "b.0"),
            Step("requests", "b.0", n=9),
            Step("restart", "a.0", n=1),
            # Half the burst before kvindex dies, the rest from a new engine process while it is down.
            Step("kvindex_restart", bursts=(Burst("a.0", 4, 3, restart=True),)),
            Step("disconnect", "a.0", n=5, restart=True),  # the engine restarts while its link is cut
        ),
    )
    assert batch_counts(schedule) == {"a.0": [6, 9, 3, 2, 5], "b.0": [5]}
    assert {"restart_shorter", "restart_longer", "late_start", "stall_burst"} <= kinds_of(schedule)


def test_every_request_publishes_exactly_one_batch() -> None:
    prefixes = [[1] * 16, [2] * 32]
    for prompt, max_tokens in prompts(prefixes, seed=3, n=200):
        # At least one block of fresh tokens after any shared prefix: a BlockStored every time.
        assert len(prompt) >= 16 and max_tokens >= 1


def test_the_verdict_follows_the_rule() -> None:
    held = frozenset({1, 2, 3})

    def outcome(claims: set[int], state: str | None = "live", partial: bool = False, history: int = 5) -> str:
        verdict = judge(
            "p0.0", held, frozenset(claims), state=state, partial_view=partial, history=history, ring=10
        )
        return verdict.outcome

    assert outcome({1, 2, 3}) == "exact"
    assert outcome({1, 2, 3}, state="resyncing", history=50) == "exact"
    assert outcome({1, 2}) == "divergent"  # missing on a pod that says it is live
    assert outcome({1, 2}, state="resyncing", history=50) == "flagged"
    assert outcome({1, 2}, partial=True, history=50) == "flagged"
    assert outcome({1, 2}, state="resyncing", history=10) == "flagged_needlessly"  # the ring held it all
    assert outcome({1, 2, 3, 4}, state="resyncing", history=50) == "divergent"  # a block not held
    assert outcome(set(), state=None) == "divergent"
    unseen = judge(
        "p0.0", held, frozenset(), state=None, partial_view=False, history=1, ring=10, unseeable=True
    )
    assert unseen.outcome == "unseen"
    assert worst(["exact", "flagged", "divergent", "exact"]) == "divergent" and worst([]) == "exact"


def test_shrinking_finds_the_two_steps_that_fail_together() -> None:
    steps = [Step("requests", "p0.0", n=3, seed=i) for i in range(20)]
    steps[6] = Step("clear", "p0.0")
    steps[13] = Step("restart", "p0.0", n=8)
    schedule = one_engine(steps)

    def fails(candidate: Schedule) -> bool:
        actions = [step.action for step in candidate.steps]
        return "clear" in actions and "restart" in actions

    result = shrink(schedule, fails)
    assert [step.action for step in result.shrunk.steps] == ["kvindex_start", "clear", "restart"]
    assert result.shrunk.steps[2].n == 1  # burst sizes halved as far as they still fail
    assert not result.exhausted and result.runs < 60
    assert "restart" in format_schedule(result.shrunk)


def test_shrinking_stops_at_its_budget() -> None:
    schedule = one_engine([Step("requests", "p0.0", n=2, seed=i) for i in range(40)])
    calls = []

    def fails(candidate: Schedule) -> bool:
        calls.append(candidate)
        return len(candidate.steps) > 30  # anything big enough fails: shrinking never stops on its own

    result = shrink(schedule, fails, max_runs=5)
    assert len(calls) == 5 and result.exhausted and len(result.shrunk.steps) > 30


def test_port_pools_never_hand_out_the_same_port_while_it_is_held() -> None:
    """Two schedules running at once (two pools, the same random sequence): the second skips every port
    the first still holds, and gets them once the first is closed."""
    first, second = PortPool(random.Random(7)), PortPool(random.Random(7))
    try:
        held = {first.run(1) for _ in range(20)}
        assert len(held) == 20 and not held & {second.run(1) for _ in range(20)}
        first.close()
        third = PortPool(random.Random(7))
        try:
            assert third.run(1) in held  # released: the same sequence gets its first port again
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_a_cut_link_carries_nothing_until_it_is_restored(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    ports = PortPool(random.Random())
    pub_port, proxy_port = ports.run(1), ports.run(1)
    pub = ctx.socket(zmq.PUB)
    pub.bind(tcp(pub_port))
    proxy = LinkProxy(proxy_port, pub_port)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
    sub.connect(proxy.endpoint)

    def arrives(attempts: int) -> bool:
        for _ in range(attempts):
            pub.send(b"x")
            if sub.poll(20):
                while sub.poll(0):
                    sub.recv()
                return True
        return False

    try:
        assert arrives(250), "nothing crossed the link"
        assert proxy.accepted >= 1
        proxy.cut()
        while sub.poll(50):  # what was in flight before the cut
            sub.recv()
        assert not arrives(20), "a cut link carried a message"
        proxy.restore()
        assert arrives(250), "the restored link carried nothing"
    finally:
        proxy.close()
        ports.close()
        for sock in (pub, sub):
            sock.close(linger=0)


def test_the_command_prints_a_table_per_fault_kind() -> None:
    lines = run_quick("benchmarks.faults", timeout_s=240)
    assert lines[0].split()[:3] == ["fault", "kind", "schedules"]
    all_row = next(line for line in lines if line.startswith("all "))
    assert int(all_row.split()[1]) == 4
    assert any("schedules in" in line for line in lines)
