"""Routing policies the demo compares: where does a router send the next request?

Pure decisions from values the caller measured (kvindex scores, in-flight requests per pod); the demo's
shell (cli/cmd_demo.py) fetches the scores over HTTP and sends the request. Each policy object keeps its
own small state (cursor, seeded RNG, assignment counts), so a fresh object replays identically.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

KV_AWARE = "kv-aware"
ROUND_ROBIN = "round-robin"
RANDOM = "random"
POLICY_NAMES = (KV_AWARE, ROUND_ROBIN, RANDOM)


class RoutingPolicy(Protocol):
    name: str
    needs_scores: bool  # True: the caller asks kvindex for scores before each choice

    def choose(
        self, pod_ids: Sequence[str], scores: Mapping[str, float], outstanding: Mapping[str, int]
    ) -> str:
        """The pod for the next request. `scores` omits pods with nothing cached (score 0)."""
        ...


class KvAwarePolicy:
    """Best kvindex score; ties by fewest in-flight requests, then fewest assigned so far, then
    round-robin order (so a cold fleet spreads new prefixes instead of piling them on one pod)."""

    name = KV_AWARE
    needs_scores = True

    def __init__(self) -> None:
        self._num_assigned: dict[str, int] = {}
        self._cursor = 0

    def choose(
        self, pod_ids: Sequence[str], scores: Mapping[str, float], outstanding: Mapping[str, int]
    ) -> str:
        if not pod_ids:
            raise ValueError("no pods to route to")
        num_pods = len(pod_ids)

        def rank(position: int) -> tuple[float, int, int, int]:
            pod_id = pod_ids[position]
            return (
                -scores.get(pod_id, 0.0),
                outstanding.get(pod_id, 0),
                self._num_assigned.get(pod_id, 0),
                (position - self._cursor) % num_pods,
            )

        best = min(range(num_pods), key=rank)
        self._cursor = (best + 1) % num_pods
        pod_id = pod_ids[best]
        self._num_assigned[pod_id] = self._num_assigned.get(pod_id, 0) + 1
        return pod_id


class RoundRobinPolicy:
    name = ROUND_ROBIN
    needs_scores = False

    def __init__(self) -> None:
        self._cursor = 0

    def choose(
        self, pod_ids: Sequence[str], scores: Mapping[str, float], outstanding: Mapping[str, int]
    ) -> str:
        if not pod_ids:
            raise ValueError("no pods to route to")
        pod_id = pod_ids[self._cursor % len(pod_ids)]
        self._cursor += 1
        return pod_id


class RandomPolicy:
    name = RANDOM
    needs_scores = False

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, pod_ids: Sequence[str], scores: Mapping[str, float], outstanding: Mapping[str, int]
    ) -> str:
        if not pod_ids:
            raise ValueError("no pods to route to")
        return self._rng.choice(list(pod_ids))


def make_policy(name: str, seed: int) -> RoutingPolicy:
    """A fresh policy by its table label (`kv-aware`, `round-robin`, `random`)."""
    if name == KV_AWARE:
        return KvAwarePolicy()
    if name == ROUND_ROBIN:
        return RoundRobinPolicy()
    if name == RANDOM:
        return RandomPolicy(seed)
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
