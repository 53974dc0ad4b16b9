"""Several `kvindex serve` replicas sharing one index in a real redis-server, fed by real engine streams
(the project's EventPublisher over ZMQ on 127.0.0.1), read over real HTTP.

Expected scores come from the engines' own record of what they hold (tests/engines.py), never from
kvindex. Covers: both replicas exact with the pods split between them; kill -9 of one replica (its pods
taken over within the lease TTL, exact again); redis-server restarted empty (exact again); redis-server
down (503s with `store: ...`, then recovery); a replica started later (handed its share of the pods); a
stalled redis-server (scores wait, health checks do not);
a replica on a real 3-node Redis Cluster, named by `redis+cluster://` or detected behind a plain
`redis://` URL (exact, owning every pod); a cluster URL naming DB 1 (refused at start); and the store-less
alternative (two in-memory replicas each consuming every pod give the same scores).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from engines import Engine
from kvindex.hashing.hasher import MIN_HELD_STRETCH_BLOCKS
from prompt_metrics import prompt_block_counts
from waiting import wait_for

from benchmarks.service import KvindexService, engine_index_of

pytestmark = pytest.mark.timeout(180)

NUM_ENGINES = 4
LEASE_TTL_S = 2.0
# A takeover: the dead owner's lease lapses (TTL), then a survivor's next tick (TTL/5) takes it; a
# join from the ring and a score read follow. Generous for a loaded 2-core CI box.
TAKEOVER_LIMIT_S = LEASE_TTL_S + 8.0


def http_get(port: int, path: str) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def http_score(port: int, block_hashes: Sequence[int]) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": "m", "block_hashes": list(block_hashes)})
        connection.request("POST", "/v1/score", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


class Fleet:
    """Engines with a few stored chains each; the prompts to score are every chain stored so far."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.prompts: list[list[int]] = []
        self._random = random.Random(13)

    def store_round(self, blocks: int = 3) -> None:
        for number, engine in enumerate(self.engines):
            keys = [self._random.getrandbits(64) for _ in range(blocks + number)]
            engine.store(keys, [], block_size=16)
            self.prompts.append(keys)
        # Shared prefixes: every other engine also stores the first engine's newest chain, in part.
        shared = self.prompts[-len(self.engines)]
        for number, engine in enumerate(self.engines[1:]):
            engine.store(shared[: 1 + number], [], block_size=16)
        for engine in self.engines:
            engine.flush()

    def expected(self, prompt: Sequence[int]) -> dict[int, int]:
        """Engine index -> leading blocks of `prompt` it holds (0s omitted): from the engines' caches."""
        result: dict[int, int] = {}
        for index, engine in enumerate(self.engines):
            matched = 0
            for key in prompt:
                if key not in engine.held:
                    break
                matched += 1
            if matched:
                result[index] = matched
        return result


def scores_of(port: int, prompt: Sequence[int]) -> dict[int, int] | None:
    status, body = http_score(port, prompt)
    if status != 200:
        return None
    return {engine_index_of(s["pod"]): s["matched_blocks"] for s in body["scores"] if s["matched_blocks"]}


def exact(service: KvindexService, fleet: Fleet) -> bool:
    return all(scores_of(service.port, prompt) == fleet.expected(prompt) for prompt in fleet.prompts)


def owners(service: KvindexService) -> dict[str, str | None]:
    return {pod["pod"]: pod.get("owner") for pod in service.pods()}


@pytest.fixture
def fleet(engines: list[Engine]) -> Fleet:
    for number in range(NUM_ENGINES):
        engines.append(Engine(f"engine-{number}"))
    made = Fleet(engines)
    made.store_round()
    return made


def replica(fleet: Fleet, *args: str) -> KvindexService:
    return KvindexService(
        [engine.endpoint for engine in fleet.engines],
        replay_endpoints=[engine.replay_endpoint for engine in fleet.engines],
        model="m",
        extra_args=args,
        ingest={"quiet_probe_after_s": 0.5},
    )


@pytest.fixture
def replicas(fleet: Fleet, redis_url: str) -> Iterator[list[KvindexService]]:
    started: list[KvindexService] = []
    try:
        for name in ("r1", "r2"):
            service = replica(
                fleet, "--store", redis_url, "--lease-ttl", str(LEASE_TTL_S), "--replica-id", name
            )
            service.start()
            started.append(service)
        yield started
    finally:
        for service in started:
            service.stop()


def await_exact(services: Sequence[KvindexService], fleet: Fleet, what: str, timeout_s: float = 30.0) -> None:
    for service in services:
        wait_for(
            lambda s=service: exact(s, fleet),
            timeout_s=timeout_s,
            poll_s=0.1,
            what=f"{what} ({s_id(service)})",
        )


def s_id(service: KvindexService) -> str:
    return f"replica on port {service.port}"


def score_unheld_prompt(port: int) -> tuple[float, float]:
    """Score a 100-block token prompt nobody holds; the blocks it hashed and left unhashed (/metrics)."""
    before = prompt_block_counts(f"http://127.0.0.1:{port}")
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(
            "POST", "/v1/score", body=json.dumps({"model": "m", "token_ids": list(range(1600))})
        )
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    after = prompt_block_counts(f"http://127.0.0.1:{port}")
    return after.get("true", 0) - before.get("true", 0), after.get("false", 0) - before.get("false", 0)


def test_two_replicas_own_each_pod_once_and_both_answer_exactly(
    fleet: Fleet, replicas: list[KvindexService]
) -> None:
    await_exact(replicas, fleet, "exact scores from both replicas")
    # A prompt nobody holds: with a shared store every one of its 100 blocks is hashed (asking the store
    # where to stop would cost a round trip a question); an in-memory index would stop after 32.
    assert score_unheld_prompt(replicas[0].port) == (100, 0)
    wait_for(
        lambda: (
            set(owners(replicas[0]).values()) <= {"r1", "r2"} and None not in owners(replicas[0]).values()
        ),
        timeout_s=20,
        poll_s=0.1,
        what="every pod owned",
    )
    assert owners(replicas[0]) == owners(replicas[1])
    fleet.store_round()
    for engine in fleet.engines:
        engine.remove_oldest()
        engine.flush()
    await_exact(replicas, fleet, "exact after more stores and removals")
    # A non-owner learns the owner's states at its next lease tick: ready soon after, not at once.
    for service in replicas:
        wait_for(lambda s=service: http_get(s.port, "/readyz")[0] == 200, timeout_s=10, what="/readyz 200")


def test_kill_9_of_an_owner_hands_its_pods_over_within_the_ttl(
    fleet: Fleet, replicas: list[KvindexService]
) -> None:
    await_exact(replicas, fleet, "exact scores from both replicas")
    wait_for(
        lambda: None not in owners(replicas[0]).values(), timeout_s=20, poll_s=0.1, what="every pod owned"
    )
    victim, survivor = replicas
    killed_at = time.monotonic()
    victim.kill()
    wait_for(
        lambda: set(owners(survivor).values()) == {"r2"},
        timeout_s=TAKEOVER_LIMIT_S,
        poll_s=0.05,
        what="the survivor owning every pod",
    )
    took_s = time.monotonic() - killed_at
    assert took_s <= TAKEOVER_LIMIT_S
    fleet.store_round()  # written while the survivor is the only replica
    await_exact([survivor], fleet, "exact after the takeover")


def test_a_replica_started_later_is_handed_its_share_of_the_pods(fleet: Fleet, redis_url: str) -> None:
    args = ("--store", redis_url, "--lease-ttl", str(LEASE_TTL_S))
    first = replica(fleet, *args, "--replica-id", "r1")
    late = replica(fleet, *args, "--replica-id", "late")
    try:
        first.start()
        wait_for(lambda: set(owners(first).values()) == {"r1"}, timeout_s=20, what="r1 owning every pod")
        await_exact([first], fleet, "exact from the only replica")
        late.start()
        # Once "late" has been live for 10 lease ticks, r1 hands over the pods rendezvous hashing gives
        # it, one per tick: wait for a split that holds over a whole TTL.
        seen: list[dict[str, str | None]] = []

        def settled_split() -> bool:
            seen.append(owners(late))
            recent = seen[-int(LEASE_TTL_S / 0.2) :]
            return set(seen[-1].values()) == {"r1", "late"} and all(split == seen[-1] for split in recent)

        wait_for(
            settled_split, timeout_s=40, poll_s=0.2, what="the pods split between r1 and the later replica"
        )
        split = seen[-1]
        fleet.store_round()
        await_exact([first, late], fleet, "exact from both after the handover")
        time.sleep(2 * LEASE_TTL_S)  # ok: a settled split must stay put (no pod bouncing back and forth)
        assert owners(first) == owners(late) == split
    finally:
        late.stop()
        first.stop()


def test_redis_restarted_empty_every_pod_rejoins(
    fleet: Fleet, replicas: list[KvindexService], redis_server: Any
) -> None:
    await_exact(replicas, fleet, "exact scores from both replicas")
    redis_server.stop()
    redis_server.start()  # empty: no persistence
    await_exact(replicas, fleet, "exact again after redis-server restarted empty", timeout_s=40)
    fleet.store_round()
    await_exact(replicas, fleet, "exact with new blocks after the restart")


def test_redis_down_answers_503_then_recovers(
    fleet: Fleet, replicas: list[KvindexService], redis_server: Any
) -> None:
    await_exact(replicas, fleet, "exact scores from both replicas")
    redis_server.stop()
    for service in replicas:
        status, body = http_score(service.port, fleet.prompts[0])
        assert status == 503 and body["error"].startswith("store: "), body
        # The lease thread notices at its next tick (every TTL/5).
        wait_for(
            lambda s=service: http_get(s.port, "/readyz")[1].get("error", "").startswith("store: "),
            timeout_s=10,
            what="/readyz 503 naming the store",
        )
        assert http_get(service.port, "/readyz")[0] == 503
    fleet.store_round()  # the engines go on while the store is away
    redis_server.start()
    await_exact(replicas, fleet, "exact after the store came back", timeout_s=40)
    for service in replicas:
        wait_for(lambda s=service: http_get(s.port, "/readyz")[0] == 200, timeout_s=20, what="/readyz 200")


def test_a_stalled_store_holds_up_scores_but_not_health_checks(
    fleet: Fleet, replicas: list[KvindexService], redis_server: Any
) -> None:
    await_exact(replicas, fleet, "exact scores from both replicas")
    service = replicas[0]
    assert redis_server.process is not None
    answers: list[tuple[int, Any]] = []
    os.kill(redis_server.process.pid, signal.SIGSTOP)  # answers nothing, refuses nothing
    try:
        # A score waits on the store (up to its socket timeout, 5 s by default) ...
        scoring = threading.Thread(target=lambda: answers.append(http_score(service.port, fleet.prompts[0])))
        scoring.start()
        time.sleep(0.5)  # ok: lets the score reach the store before the health checks below
        began = time.monotonic()
        for path in ("/healthz", "/healthz", "/healthz"):
            assert http_get(service.port, path)[0] == 200
        answered_s = time.monotonic() - began
        # ... while the process keeps answering everything that does not need the store.
        assert scoring.is_alive(), answers
        assert answered_s < 1.0, f"/healthz took {answered_s:.2f} s behind a stalled store read"
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    scoring.join(15)
    status, body = answers[0]
    assert status == 200 or (status == 503 and body["error"].startswith("store: ")), body
    await_exact(replicas, fleet, "exact after the store answered again", timeout_s=40)


@pytest.mark.parametrize("form", ["redis+cluster", "redis"])
def test_a_replica_on_a_redis_cluster_answers_exactly(
    fleet: Fleet, redis_cluster_url: str, redis_cluster: Any, form: str
) -> None:
    url = redis_cluster_url if form == "redis+cluster" else redis_cluster.plain_url
    service = replica(
        fleet, "--store", url, "--lease-ttl", str(LEASE_TTL_S), "--replica-id", "c1", "--log-level", "info"
    )
    try:
        service.start()
        await_exact([service], fleet, "exact scores from the replica on the cluster")
        wait_for(lambda: set(owners(service).values()) == {"c1"}, timeout_s=20, what="every pod owned by c1")
        fleet.store_round()
        for engine in fleet.engines:
            engine.remove_oldest()
            engine.flush()
        await_exact([service], fleet, "exact after more stores and removals")
        detected = service.log_tail(1 << 20).count("has cluster mode on: using a Redis Cluster client")
        assert detected == (1 if form == "redis" else 0)
    finally:
        service.stop()


def test_a_cluster_url_naming_db_1_stops_serve_with_one_sentence(fleet: Fleet, redis_cluster: Any) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster.ports[0]}/1"
    service = replica(fleet, "--store", url)
    with pytest.raises(RuntimeError) as caught:
        service.start()
    assert f"{url} is a Redis Cluster, which has only DB 0: drop /1 from the URL" in str(caught.value)


def test_in_memory_replicas_each_consume_every_pod_and_agree(fleet: Fleet) -> None:
    services = [replica(fleet), replica(fleet)]
    try:
        for service in services:
            service.start()
        await_exact(services, fleet, "exact scores from both in-memory replicas")
        fleet.store_round()
        await_exact(services, fleet, "exact after more stores")
        for prompt in fleet.prompts:
            assert scores_of(services[0].port, prompt) == scores_of(services[1].port, prompt)
        assert all(pod.get("owner") is None for pod in services[0].pods())
        # The in-memory index is asked where to stop: one stretch hashed, the rest left.
        assert score_unheld_prompt(services[0].port) == (
            MIN_HELD_STRETCH_BLOCKS,
            100 - MIN_HELD_STRETCH_BLOCKS,
        )
    finally:
        for service in services:
            service.stop()
