"""`kvindex demo` end to end (simulated engines -> ingest -> HTTP API -> routing), plus its pure parts.

The smoke test runs the real command in a subprocess; the hit rates it compares are the ones the
simulated engines reported, so kv-aware beating round-robin is measured, not assumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kvindex.demo.policies import KvAwarePolicy, RandomPolicy, RoundRobinPolicy, make_policy
from kvindex.demo.report import PolicyResult, format_table, percentile
from kvindex.demo.workload import WorkloadSpec, generate_trace, shareable_token_fraction

DEMO_TIMEOUT_S = 120


def _run_demo(*extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    return subprocess.run(
        [sys.executable, "-m", "kvindex", "demo", "--requests", "60", "--pods", "3", *extra],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env,
        check=False,
    )


def test_demo_prints_the_table_and_kv_aware_wins() -> None:
    completed = _run_demo()
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    header = next(n for n, line in enumerate(lines) if line.startswith("policy "))
    assert set(lines[header + 1]) == {"-", " "}
    rows = {}
    for line in lines[header + 2 :]:
        if not line.strip():
            break  # the table ends at the first blank line
        cells = line.split()
        rows[cells[0]] = cells
    assert set(rows) == {"kv-aware", "round-robin", "random"}, completed.stdout
    # columns: policy, requests, hit rate, prefill tokens, score p50 (value unit | -), ...
    hit_rate = {name: float(cells[2].rstrip("%")) for name, cells in rows.items()}
    assert hit_rate["kv-aware"] > hit_rate["round-robin"], completed.stdout
    assert rows["round-robin"][4] == "-" and rows["random"][4] == "-"
    assert rows["kv-aware"][5] == "ms"  # a measured latency, not "-"


def test_demo_json_is_consistent() -> None:
    completed = _run_demo("--json", "--seed", "7")
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    policies = {entry["policy"]: entry for entry in result["policies"]}
    assert list(policies) == ["kv-aware", "round-robin", "random"]
    for entry in policies.values():
        assert entry["requests"] == 60
        assert entry["errors"] == 0
        assert 0 <= entry["cached_tokens"] <= entry["prompt_tokens"]
        assert entry["prefill_tokens"] == entry["prompt_tokens"] - entry["cached_tokens"]
        assert entry["events_indexed"] > 0
        # No policy can beat a single unbounded cache that saw every request.
        assert entry["hit_rate"] <= result["shareable_fraction"] + 1e-9
    # Same trace under every policy: same prompt tokens.
    assert len({entry["prompt_tokens"] for entry in policies.values()}) == 1
    assert policies["kv-aware"]["hit_rate"] > policies["round-robin"]["hit_rate"]
    assert policies["kv-aware"]["score_p50_ms"] is not None
    assert policies["random"]["score_p50_ms"] is None


def test_demo_with_a_sidecar_per_engine() -> None:
    """The same trace through a kvindex sidecar per engine: the indexer follows the sidecars and still
    routes better than round-robin (the hit rates are the engines' own)."""
    completed = _run_demo("--json", "--seed", "7", "--sidecars")
    assert completed.returncode == 0, completed.stderr
    policies = {entry["policy"]: entry for entry in json.loads(completed.stdout)["policies"]}
    assert all(entry["requests"] == 60 and entry["errors"] == 0 for entry in policies.values())
    assert all(entry["events_indexed"] > 0 for entry in policies.values())
    assert policies["kv-aware"]["hit_rate"] > policies["round-robin"]["hit_rate"]


def test_demo_rejects_bad_flags_with_one_sentence() -> None:
    completed = _run_demo("--capacity-blocks", "4")
    assert completed.returncode == 2
    assert completed.stderr.startswith("kvindex demo: --capacity-blocks must be at least")
    assert "Traceback" not in completed.stderr


# --- the pure parts ------------------------------------------------------------------------------------


def test_trace_is_deterministic_and_conversations_grow() -> None:
    spec = WorkloadSpec(num_requests=300, seed=3)
    trace = generate_trace(spec)
    assert trace == generate_trace(spec)
    assert trace != generate_trace(WorkloadSpec(num_requests=300, seed=4))
    assert len(trace) == 300
    by_index = {request.index: request for request in trace}
    turns = [request for request in trace if request.after is not None]
    assert turns
    for request in turns:
        previous = by_index[request.after]
        assert previous.index < request.index
        assert previous.conversation == request.conversation
        assert request.turn == previous.turn + 1
        # Each turn re-sends the whole history, then adds the reply and the new user turn.
        assert request.token_ids[: len(previous.token_ids)] == previous.token_ids
        assert len(request.token_ids) > len(previous.token_ids)
    assert any(request.kind == "unique" for request in trace)
    assert all(1_000 <= token < 128_000 for request in trace for token in request.token_ids)


def test_shareable_fraction_counts_repeated_prefix_blocks_only() -> None:
    from kvindex.demo.workload import DemoRequest

    def request(index: int, tokens: list[int]) -> DemoRequest:
        return DemoRequest(index, tuple(tokens), 1, "unique", None, 0, None)

    a = list(range(1000, 1008))
    b = list(range(2000, 2008))
    # Blocks of 8 tokens: [a b] twice, then [b a] (same tokens, different chain).
    trace = [request(0, a + b), request(1, a + b), request(2, b + a)]
    # 48 tokens sent; only request 1 repeats an earlier prefix (16 tokens); [b a] starts a new chain.
    assert shareable_token_fraction(trace, 8) == pytest.approx(16 / 48)


def test_kv_aware_prefers_score_then_load_then_rotation() -> None:
    pods = ["a", "b", "c"]
    policy = KvAwarePolicy()
    assert policy.choose(pods, {"b": 5.0, "c": 2.0}, {"a": 0, "b": 9, "c": 0}) == "b"
    # No scores: the least loaded pod.
    assert policy.choose(pods, {}, {"a": 2, "b": 1, "c": 3}) == "b"
    # Full tie on score and load: fewest assigned so far (a and c have none; rotation after b is c).
    assert policy.choose(pods, {}, {"a": 0, "b": 0, "c": 0}) == "c"
    assert policy.choose(pods, {}, {"a": 0, "b": 0, "c": 0}) == "a"


def test_baseline_policies() -> None:
    pods = ["a", "b", "c"]
    round_robin = RoundRobinPolicy()
    assert [round_robin.choose(pods, {}, {}) for _ in range(4)] == ["a", "b", "c", "a"]
    picks = [RandomPolicy(seed=1).choose(pods, {}, {}) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first pick
    assert make_policy("random", 1).name == "random"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("least-loaded", 0)


def test_table_rows_and_percentiles() -> None:
    kv_aware = PolicyResult("kv-aware", requests=2, prompt_tokens=200, cached_tokens=150)
    kv_aware.score_latencies_ms.extend([1.0, 2.0, 3.0, 4.0])
    baseline = PolicyResult("round-robin", requests=2, prompt_tokens=200, cached_tokens=50)
    table = format_table([kv_aware, baseline]).splitlines()
    assert table[2].split()[:4] == ["kv-aware", "2", "75.0%", "50"]
    assert table[3].split() == ["round-robin", "2", "25.0%", "150", "-", "-", "0"]
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.99) == 4.0
    assert percentile([], 0.5) is None
