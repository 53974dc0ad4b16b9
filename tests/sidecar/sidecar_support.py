"""Shared parts of the sidecar tests (no tests here): a real sidecar (ingest + relay + downstream
publisher + HTTP on 127.0.0.1) in front of engines.Engine streams, a central IngestService dialling it,
and the check that an index holds exactly what each engine holds (the engine's own reference)."""

from __future__ import annotations

from collections.abc import Sequence

from engines import Engine
from kvindex.indexer.events import PodRef
from kvindex.indexer.index import KVIndex
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import PodStatus
from kvindex.sidecar.http import HttpThread
from kvindex.sidecar.service import SidecarService
from kvindex.sidecar.settings import SidecarSettings

MODEL = ModelConfig(name="m")
CENTRAL = IngestSettings(num_workers=1, quiet_probe_after_s=0.3, replay_timeout_s=5.0, hash_check_every=1)


class RunningSidecar:
    """A sidecar for one engine (one DP rank) with its HTTP app; `close()` stops both."""

    def __init__(
        self,
        engine: Engine,
        *,
        buffer_steps: int = 10_000,
        publish: str = "tcp://127.0.0.1:0",
        replay: str = "tcp://127.0.0.1:0",
        http_port: int = 0,
        model: ModelConfig = MODEL,
    ) -> None:
        settings = SidecarSettings(
            pod_id=engine.pod_id,
            model=model,
            engines=(engine.endpoint,),
            engine_replays=(engine.replay_endpoint,),
            publish=publish,
            replay=replay,
            buffer_steps=buffer_steps,
            publish_bind=True,
            quiet_probe_after_s=0.3,
        )
        self.service = SidecarService(settings)
        self.service.start()
        self.http = HttpThread(self.service, port=http_port)
        self.url = self.http.start()
        publisher = self.service.publishers[0]
        self.endpoint = publisher.endpoint
        self.replay_endpoint = publisher.replay_endpoint
        self.pod_id = engine.pod_id

    @property
    def snapshot_url(self) -> str:
        return f"{self.url}/v1/snapshot"

    def pod_config(self, *, snapshot_url: str | None = "") -> PodConfig:
        """How a central kvindex reaches this sidecar ("" for the snapshot URL: this sidecar's)."""
        return PodConfig(
            pod_id=self.pod_id,
            endpoint=self.endpoint,
            model=MODEL.name,
            replay_endpoint=self.replay_endpoint,
            snapshot_url=self.snapshot_url if snapshot_url == "" else snapshot_url,
        )

    def downstream_seq(self) -> int | None:
        return self.service.relay.downstream_seq(0)

    def close(self) -> None:
        self.http.stop()
        self.service.stop()


def central(pods: Sequence[PodConfig], settings: IngestSettings = CENTRAL) -> IngestService:
    service = IngestService([MODEL], pods, settings=settings)
    service.start()
    return service


def index_of(service: IngestService) -> KVIndex:
    runtime = service.model(MODEL.name)
    assert runtime is not None
    return runtime.index


def held_by(index: KVIndex, pod: PodRef, universe: set[int]) -> dict[int, set[str]]:
    """Key -> the tiers the index says `pod` holds it on, for the keys of `universe` it holds."""
    out: dict[int, set[str]] = {}
    for key in universe:
        holders = index.lookup([key])
        tiers = {tier for entry_pod, tier in (holders[0] if holders else ()) if entry_pod == pod}
        if tiers:
            out[key] = tiers
    return out


def matches(index: KVIndex, engine: Engine) -> bool:
    """The index holds exactly the engine's blocks, on the engine's tiers."""
    return held_by(index, engine.ref, engine.ever) == engine.held


def status_of(service: IngestService, pod_id: str, dp_rank: int = 0) -> PodStatus:
    return next(s for s in service.pod_statuses() if (s.pod, s.dp_rank) == (pod_id, dp_rank))
