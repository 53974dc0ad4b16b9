"""A vLLM-compatible KV-event publisher: PUB for live batches + ROUTER replaying the last N batches.

Byte-identical to vLLM 0.33's ZmqEventPublisher on the wire (same frames, same payload bytes, same
replay replies), used by the engine simulator and the sidecar.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from kvindex.replay.wire import KVEventBatch, WireEvent


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint has `*` or `::`, or is ipc:// / inproc://; else connect."""
    raise NotImplementedError


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's data-parallel offset, applied to both the PUB and the replay endpoint."""
    raise NotImplementedError


def encode_batch(batch: KVEventBatch) -> bytes:
    raise NotImplementedError


class EventPublisher:
    """Publishes batches with seq 0, 1, 2, ... ; keeps the last `buffer_steps` for replay.

    `publish` never blocks its caller indefinitely. `endpoint` / `replay_endpoint` are the effective
    addresses (after the DP offset and after resolving an ephemeral port `tcp://host:0`).
    """

    endpoint: str
    replay_endpoint: str | None

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        dp_rank: int = 0,
        ctx: zmq.Context | None = None,
    ) -> None:
        raise NotImplementedError

    def publish(self, events: Sequence[WireEvent], *, ts: float | None = None) -> None:
        raise NotImplementedError

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued has been sent; False on timeout."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
