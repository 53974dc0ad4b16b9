"""A fleet larger than libzmq's default socket limit (1,023 per context) must start: each connect-mode pod
costs a SUB plus a monitor pair, so ~340 pods exhausted it before the context was sized for the fleet."""

from __future__ import annotations

from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig


def test_service_with_600_pods_starts_and_stops() -> None:
    # Port 9 on loopback: nothing listens, ZMQ keeps retrying in the background; no replay sockets, so
    # no joins are attempted. The point is only that every subscription can be created.
    pods = [PodConfig(f"pod-{i}", "tcp://127.0.0.1:9", model="m") for i in range(600)]
    service = IngestService(
        [ModelConfig("m", hash_seed="0")], pods, settings=IngestSettings(reconnect_ivl_ms=1000)
    )
    service.start()
    try:
        assert len(service.pod_statuses()) == 600
    finally:
        service.stop()
