"""A pod's state as its sidecar serves it at `GET /v1/snapshot`: per DP rank and tier the block hashes it
holds, and the sidecar's downstream seq that state reflects. The sidecar (sidecar/) encodes it; the central
ingest pipeline (indexer/ingest/) decodes it on a join or a gap older than the ring and loads it instead
of clearing the pod. The schema is part of the interface (docs/CONTRACT.md): evolve it only by appending
fields with defaults. Pure: no IO, clocks or threads.
"""

from __future__ import annotations

import msgspec

SNAPSHOT_SCHEMA = "kvindex-sidecar-snapshot/1"
# Content types the sidecar answers with (msgpack by default, JSON on `Accept: application/json`).
MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"


class TierBlocks(msgspec.Struct, frozen=True):
    """The blocks one (rank, tier) holds, in the order they were first stored.

    `copies`: empty when every block is held once; otherwise one count per hash (a block stored again
    before it was removed is held twice, as the index counts it: one BlockRemoved drops one copy)."""

    tier: str
    block_hashes: list[int]
    copies: list[int] = []


class RankSnapshot(msgspec.Struct, frozen=True):
    """One DP rank: the downstream seq its state reflects (None: nothing published on it yet), whether
    the state is known to be incomplete (the engine's history was lost before the sidecar saw it), and
    the sidecar's hash check of that rank's engine."""

    dp_rank: int
    seq: int | None
    partial: bool
    tiers: list[TierBlocks]
    hash_checks_total: int = 0
    hash_mismatches_total: int = 0


class PodSnapshot(msgspec.Struct, frozen=True):
    """`sidecar_id` changes whenever the sidecar process restarts (its downstream seqs start again at 0)."""

    schema: str
    sidecar_id: str
    pod: str
    model: str
    block_size: int
    ranks: list[RankSnapshot]

    def rank(self, dp_rank: int) -> RankSnapshot | None:
        return next((r for r in self.ranks if r.dp_rank == dp_rank), None)


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message is one sentence saying why."""


_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_DECODER = msgspec.msgpack.Decoder(PodSnapshot)
_JSON_DECODER = msgspec.json.Decoder(PodSnapshot)


def encode_snapshot(snapshot: PodSnapshot, *, as_json: bool = False) -> bytes:
    return _JSON_ENCODER.encode(snapshot) if as_json else _MSGPACK_ENCODER.encode(snapshot)


def decode_snapshot(body: bytes, content_type: str | None) -> PodSnapshot:
    """Decode and check a snapshot body (JSON when the content type says so, else msgpack); raises
    SnapshotError naming the first problem."""
    is_json = content_type is not None and content_type.split(";")[0].strip() == JSON_CONTENT_TYPE
    try:
        snapshot = (_JSON_DECODER if is_json else _MSGPACK_DECODER).decode(body)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"unreadable snapshot ({len(body)} bytes): {exc}") from exc
    if snapshot.schema != SNAPSHOT_SCHEMA:
        raise SnapshotError(f"schema {snapshot.schema!r} is not {SNAPSHOT_SCHEMA!r}")
    for rank in snapshot.ranks:
        for tier in rank.tiers:
            if tier.copies and len(tier.copies) != len(tier.block_hashes):
                raise SnapshotError(
                    f"rank {rank.dp_rank} tier {tier.tier}: {len(tier.copies)} copy counts for "
                    f"{len(tier.block_hashes)} blocks"
                )
            if any(h < 0 or h >= 1 << 64 for h in tier.block_hashes):
                raise SnapshotError(f"rank {rank.dp_rank} tier {tier.tier}: a block hash is not a uint64")
            if any(c < 1 for c in tier.copies):
                raise SnapshotError(f"rank {rank.dp_rank} tier {tier.tier}: a copy count below 1")
    return snapshot


def check_snapshot_for(snapshot: PodSnapshot, pod_id: str, model: str, dp_rank: int) -> RankSnapshot:
    """The rank's part of a snapshot meant for this pod and model; SnapshotError otherwise (a snapshot
    of another pod is never loaded: a misconfigured URL must not mix pods)."""
    if snapshot.pod != pod_id:
        raise SnapshotError(f"the snapshot is pod {snapshot.pod!r}'s, not {pod_id!r}'s")
    if snapshot.model != model:
        raise SnapshotError(f"the snapshot is of model {snapshot.model!r}, not {model!r}")
    rank = snapshot.rank(dp_rank)
    if rank is None:
        raise SnapshotError(f"the snapshot has no dp rank {dp_rank}")
    return rank
