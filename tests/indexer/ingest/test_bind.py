"""The ingest pipeline in bind mode: engines dial the indexer's SUB with topic `kv@<pod>@<model>`; the
replay endpoint comes from the template (+ vLLM's DP port offset). Real EventPublishers on 127.0.0.1."""

from __future__ import annotations

import socket

from engines import Engine
from ingest_support import index_matches, status_of
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig
from waiting import wait_for

from benchmarks.faults.engines import LinkProxy

MODELS = [ModelConfig(name="m"), ModelConfig(name="org/model@v2")]


def free_port() -> int:
    """A port P such that P and P + 1 (rank 1's replay socket, vLLM's DP offset) were both free just now
    (the sockets are closed again at once); a lone free port's neighbour is often taken."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            with socket.socket() as neighbour:
                try:
                    neighbour.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port


def publish_until_seen(service: IngestService, engine: Engine) -> None:
    """Store until the service has seen the engine: a dialling PUB drops everything until our
    subscription reaches it, and a loaded machine can lose every batch published so far."""

    def seen() -> bool:
        if any((s.pod, s.dp_rank) == (engine.ref.pod_id, engine.ref.dp_rank) for s in service.pod_statuses()):
            return True
        engine.store_prompt()
        engine.flush()
        return False

    wait_for(seen, what=f"{engine.ref} seen")


def test_bind_mode_joins_keeps_dp_ranks_apart_and_survives_a_restart(engines: list[Engine]) -> None:
    # The replay port doubles as the pod id so the template can reach an ephemeral port:
    # template tcp://127.0.0.1:{pod}; rank 1's replay socket is at that port + 1 (vLLM's DP offset).
    settings = IngestSettings(
        num_workers=2,
        quiet_probe_after_s=0.3,
        hash_check_every=1,
        listen_replay_template="tcp://127.0.0.1:{pod}",
    )
    service = IngestService(MODELS, listen="tcp://127.0.0.1:*", settings=settings)
    service.start()
    try:
        listen = service.listen_endpoint
        assert listen is not None
        port = free_port()
        pod_id = str(port)
        rank0 = Engine(
            pod_id, endpoint=listen, replay_endpoint=f"tcp://127.0.0.1:{port}", topic=f"kv@{pod_id}@m"
        )
        rank1 = Engine(
            pod_id,
            endpoint=listen,
            replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
            topic=f"kv@{pod_id}@m",
            dp_rank=1,
            offset_addresses=False,
        )
        other = Engine("pod-b", endpoint=listen, replay_endpoint=None, topic="kv@pod-b@org/model@v2")
        engines += [rank0, rank1, other]
        for _ in range(10):  # the first ones are lost until each PUB has our subscription: replayed
            rank0.store_prompt()
            rank1.store_prompt()
            rank1.store_prompt()
            other.store_prompt()
        for engine in engines:
            engine.flush()
        publish_until_seen(service, rank0)
        publish_until_seen(service, rank1)
        index_m = service.model("m").index  # type: ignore[union-attr]
        index_other = service.model("org/model@v2").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index_m, [rank0, rank1]), what="both ranks indexed")
        assert status_of(service, rank0).last_seq == len(rank0.stored_order) - 1
        assert status_of(service, rank1).last_seq == len(rank1.stored_order) - 1
        assert status_of(service, rank1).model == "m"

        # pod-b has no replay socket (the template reaches nothing there): what it received is indexed.
        # With no replay socket, pod-b's first batches are lost until its PUB has our subscription (a
        # loaded machine can lose all ten): keep publishing until it is seen.
        def pod_b_seen() -> bool:
            if any(s.pod == "pod-b" and s.model == "org/model@v2" for s in service.pod_statuses()):
                return True
            other.store_prompt()
            other.flush()
            return False

        wait_for(pod_b_seen, what="model with '@'")
        wait_for(service.ready, what="ready")

        rank0.restart()
        rank0.store_prompt()
        rank0.flush()
        wait_for(lambda: index_matches(index_m, [rank0, rank1]), what="rank 0 restarted, rank 1 intact")
        assert status_of(service, rank0).restarts_total == 1
        assert status_of(service, rank1).restarts_total == 0
        assert index_other.num_keys() > 0
    finally:
        service.stop()


def test_unknown_model_in_topic_is_a_counted_drop(engines: list[Engine]) -> None:
    service = IngestService(MODELS, listen="tcp://127.0.0.1:*", settings=IngestSettings())
    service.start()
    try:
        assert service.listen_endpoint is not None
        engine = Engine(
            "pod-x", endpoint=service.listen_endpoint, replay_endpoint=None, topic="kv@pod-x@nope"
        )
        engines.append(engine)

        def dropped() -> bool:
            engine.store_prompt()  # keep publishing until our subscription has reached the PUB
            engine.flush()
            return service.counters().dropped.get("unknown_model", 0) > 0

        wait_for(dropped, what="unknown_model drop")
        assert service.pod_statuses() == []
    finally:
        service.stop()


def test_several_listen_endpoints_take_dp_ranks_that_dial_offset_ports(engines: list[Engine]) -> None:
    # vLLM offsets the PUB endpoint by the DP rank: rank r of `tcp://kvindex:P` dials P+r. Operators
    # bind one SUB per rank; every bound SUB accepts any pod and rank.
    settings = IngestSettings(
        num_workers=2, hash_check_every=1, listen_replay_template="tcp://127.0.0.1:{pod}"
    )
    service = IngestService(MODELS, listen=["tcp://127.0.0.1:*", "tcp://127.0.0.1:*"], settings=settings)
    assert service.listen_endpoints == [] and service.listen_endpoint is None  # resolved at start
    service.start()
    try:
        endpoints = service.listen_endpoints
        assert len(endpoints) == 2 and len(set(endpoints)) == 2
        assert all("*" not in e and e.startswith("tcp://127.0.0.1:") for e in endpoints)
        assert service.listen_endpoint == endpoints[0]
        port = free_port()
        pod_id = str(port)
        rank0 = Engine(
            pod_id, endpoint=endpoints[0], replay_endpoint=f"tcp://127.0.0.1:{port}", topic=f"kv@{pod_id}@m"
        )
        rank1 = Engine(
            pod_id,
            endpoint=endpoints[1],
            replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
            topic=f"kv@{pod_id}@m",
            dp_rank=1,
            offset_addresses=False,
        )
        engines += [rank0, rank1]
        for _ in range(5):  # the first ones are lost until each PUB has our subscription: replayed
            rank0.store_prompt()
            rank1.store_prompt()
        for engine in engines:
            engine.flush()
        publish_until_seen(service, rank0)
        publish_until_seen(service, rank1)
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index, [rank0, rank1]), what="both ranks indexed")
        wait_for(service.ready, what="ready")
        assert (status_of(service, rank0).endpoint, status_of(service, rank1).endpoint) == tuple(endpoints)
        assert status_of(service, rank1).last_seq == len(rank1.stored_order) - 1
    finally:
        service.stop()


def test_a_single_listen_string_is_one_endpoint() -> None:
    service = IngestService(MODELS, listen="tcp://127.0.0.1:*")
    service.start()
    try:
        assert service.listen_endpoints == [service.listen_endpoint]
        assert service.listen == ("tcp://127.0.0.1:*",)
    finally:
        service.stop()


def test_a_restart_right_after_a_probe_whose_burst_reaches_nobody_is_recovered(engines: list[Engine]) -> None:
    """The engine restarts just after kvindex probed it, bursts while its link is down (all of it lost)
    and goes quiet once the link is back. Only its ring knows: the new connection must lead to a probe,
    however recent the last one was (it was skipped, and the old incarnation's blocks stayed claimed)."""
    settings = IngestSettings(quiet_probe_after_s=1.0, listen_replay_template="tcp://127.0.0.1:{pod}")
    service = IngestService(MODELS, listen="tcp://127.0.0.1:*", settings=settings)
    service.start()
    listen = service.listen_endpoint
    assert listen is not None
    link = LinkProxy(free_port(), int(listen.rsplit(":", 1)[1]))
    try:
        port = free_port()
        engine = Engine(
            str(port), endpoint=link.endpoint, replay_endpoint=f"tcp://127.0.0.1:{port}", topic=f"kv@{port}@m"
        )
        engines.append(engine)
        publish_until_seen(service, engine)
        for _ in range(8):
            engine.store_prompt()
        engine.flush()
        index = service.model("m").index  # type: ignore[union-attr]
        wait_for(lambda: index_matches(index, [engine]), what="the first incarnation indexed")
        probes = service.counters().replays.get("ok", 0)
        wait_for(lambda: service.counters().replays.get("ok", 0) > probes, what="the quiet probe")
        link.cut()
        engine.restart()
        for _ in range(3):
            engine.store_prompt()
        engine.flush()
        link.restore()
        wait_for(lambda: index_matches(index, [engine]), what="the new incarnation, from its ring")
        assert status_of(service, engine).restarts_total == 1
    finally:
        service.stop()
        link.close()
