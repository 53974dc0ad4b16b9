"""How a sidecar runs: one frozen settings object, built once at start-up from `kvindex sidecar`'s flags."""

from __future__ import annotations

import msgspec
from kvindex.indexer.model import ModelConfig

DEFAULT_ENGINE = "tcp://127.0.0.1:5557"
DEFAULT_ENGINE_REPLAY = "tcp://127.0.0.1:5558"
DEFAULT_PUBLISH = "tcp://*:5567"
DEFAULT_REPLAY = "tcp://*:5568"
DEFAULT_HTTP_HOST = "0.0.0.0"
DEFAULT_HTTP_PORT = 8081


class SidecarSettings(msgspec.Struct, frozen=True):
    """One pod's sidecar.

    `engines[r]` / `engine_replays[r]`: DP rank r's engine PUB and replay ROUTER (already offset, as vLLM
    binds them: give one per rank). Downstream, rank r publishes on `publish` and answers replays on
    `replay` with vLLM's DP port offset +r applied, as vLLM offsets an engine's own endpoints; `publish`
    follows vLLM's rule (a `*` binds, a host name connects, e.g. to a central kvindex's `--listen`, with
    topic `kv@<pod>@<model>`). `buffer_steps`: the downstream ring, in batches per rank.
    """

    pod_id: str
    model: ModelConfig
    engines: tuple[str, ...] = (DEFAULT_ENGINE,)
    engine_replays: tuple[str | None, ...] = (DEFAULT_ENGINE_REPLAY,)
    publish: str = DEFAULT_PUBLISH
    replay: str | None = DEFAULT_REPLAY
    http_host: str = DEFAULT_HTTP_HOST
    http_port: int = DEFAULT_HTTP_PORT
    buffer_steps: int = 10_000
    # Overrides vLLM's bind-or-connect rule for `publish` (None: the rule decides); for a sidecar that must
    # bind a fixed loopback address again, as a restarted one taking over its predecessor's.
    publish_bind: bool | None = None
    hwm: int = 100_000  # the downstream PUB's SNDHWM (vLLM's KVEventsConfig.hwm)
    # The engine link's ZMQ reconnection backoff cap (a restarted engine is redialled within it).
    reconnect_ivl_max_ms: int = 5_000
    # The engine link: a short quiet-probe keeps a lost engine batch from waiting long downstream.
    quiet_probe_after_s: float = 1.0
    replay_timeout_s: float = 2.0

    @property
    def topic(self) -> str:
        return f"kv@{self.pod_id}@{self.model.name}"
