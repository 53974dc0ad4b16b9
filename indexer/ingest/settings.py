"""How the write path runs: one frozen settings object, built once at start-up (flags or TOML) and
passed down to intake, workers and the service."""

from __future__ import annotations

import msgspec


class IngestSettings(msgspec.Struct, frozen=True):
    """How the write path runs. Built once at start-up.

    Bind mode (`listen`): an engine dials in with topic `kv@<pod>@<model>` (split on the first two `@`:
    pod ids cannot contain `@`, model names may). Its replay endpoint is `listen_replay_template` with
    `{pod}` and `{model}` filled in, then vLLM's data-parallel offset applied for the batch's dp rank r > 0
    (`tcp://host:P` -> `tcp://host:P+r`, `inproc://X` -> `inproc://X_dp{r}`), exactly as vLLM offsets the
    engine's own `replay_endpoint`. Example: `tcp://{pod}:5558` reaches pod `engine-3` rank 1 at
    `tcp://engine-3:5559`. None: bind-mode pods have no replay (gaps are then lost history).

    Replays run concurrently on their own thread; a pod's live messages wait in its tracker meanwhile,
    and no other pod waits.
    """

    # Per-pod ordered workers; a pod always maps to one. One by default: under the GIL more workers did
    # not ingest faster per CPU-second but kept the GIL busier, and lookups during ingest got slower.
    num_workers: int = 1
    queue_size: int = 10_000  # messages per worker queue; overflow becomes a gap repaired by replay
    # A full queue holds the poller up to this long (messages wait in ZMQ's buffers meanwhile) before a
    # message is dropped: a burst then costs latency, not a gap (which a pod without replay can't repair).
    queue_full_wait_s: float = 2.0
    max_batch: int = 64  # messages a worker takes per wakeup (read at once, applied with one apply_many)
    silent_after_s: float = 60.0  # connected but nothing received for this long -> state `silent`
    # A disconnected pod's blocks: within the grace they still count in score answers (flagged with the
    # state); past it they are kept but left out of answers by default; past forget_after_s they are
    # dropped to free memory, and the pod's return is a fresh join.
    disconnected_grace_s: float = 30.0
    forget_after_s: float = 600.0
    quiet_probe_after_s: float = 5.0  # probe the replay socket when a pod went quiet after activity
    # A replay request fails when no reply came for this long (an idle timeout: a large ring streamed at
    # any pace completes); a failed request is retried after a doubling backoff from replay_retry_base_s
    # up to replay_retry_max_s, MAX_REPLAY_ATTEMPTS times, and counted in replays{outcome} each time.
    replay_timeout_s: float = 2.0
    replay_retry_base_s: float = 0.25
    replay_retry_max_s: float = 5.0
    # After a (re)connection, wait this long for the subscription to take effect before asking the ring.
    reconnect_settle_s: float = 0.2
    # Replay requests open at once (each a DEALER socket); more wait their turn.
    max_concurrent_replays: int = 256
    hash_check_every: int = 64  # recompute hashes of 1 in N eligible BlockStored events
    index_shards: int = 1  # under the GIL more shards only add routing work (see KVIndex)
    index_max_keys: int = 50_000_000
    index_max_pods_per_key: int = 256
    # Bind mode: replay endpoint of a pod that dialled in, from its topic `kv@<pod>@<model>`;
    # placeholders {pod}, {model}; vLLM's DP port offset is applied for ranks > 0. None: no replay.
    listen_replay_template: str | None = None
    # Bind mode: the snapshot URL of a pod that dialled in (its sidecar's GET /v1/snapshot), same
    # placeholders, no DP offset (one sidecar serves every rank of its pod). None: no snapshots.
    listen_snapshot_template: str | None = None
    # A sidecar snapshot load fails after this long without data, or past this many bytes.
    snapshot_timeout_s: float = 5.0
    snapshot_max_bytes: int = 256 << 20
    rcvhwm: int = 100_000  # per SUB socket; a full one drops at the PUB (repaired by replay)
    # A larger message makes ZMQ drop its sender's connection before reading it (vLLM's batches are a few
    # KB to a few MB: one engine step's events).
    max_message_bytes: int = 64 << 20
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000
    # Replicas sharing a store (--store redis://...): each pod is ingested by the replica holding its
    # lease; another takes it over once the lease has gone unrenewed this long.
    lease_ttl_s: float = 10.0
    # This replica's name in leases and /v1/pods (`owner`); "" = host:pid.
    replica_id: str = ""


DEFAULT_SETTINGS = IngestSettings()
