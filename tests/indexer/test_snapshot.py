"""The sidecar snapshot schema: msgpack and JSON round-trips, and every way a body is refused (one
sentence naming the problem) — truncated, wrong schema, bad hashes or copy counts, another pod's."""

from __future__ import annotations

import msgspec
import pytest
from kvindex.indexer.snapshot import (
    SNAPSHOT_SCHEMA,
    PodSnapshot,
    RankSnapshot,
    SnapshotError,
    TierBlocks,
    check_snapshot_for,
    decode_snapshot,
    encode_snapshot,
)

SNAPSHOT = PodSnapshot(
    SNAPSHOT_SCHEMA,
    "abc",
    "pod-a",
    "m",
    16,
    [
        RankSnapshot(0, 41, False, [TierBlocks("CPU", [3]), TierBlocks("GPU", [1, 2**64 - 1], [1, 2])]),
        RankSnapshot(1, None, True, []),
    ],
)


@pytest.mark.parametrize("as_json", [False, True])
def test_round_trip(as_json: bool) -> None:
    body = encode_snapshot(SNAPSHOT, as_json=as_json)
    content_type = "application/json; charset=utf-8" if as_json else "application/msgpack"
    assert decode_snapshot(body, content_type) == SNAPSHOT
    assert check_snapshot_for(SNAPSHOT, "pod-a", "m", 1).partial


def test_json_is_plain_and_documented_shape() -> None:
    doc = msgspec.json.decode(encode_snapshot(SNAPSHOT, as_json=True))
    assert doc["schema"] == SNAPSHOT_SCHEMA and doc["ranks"][0]["seq"] == 41
    assert doc["ranks"][0]["tiers"][1] == {"tier": "GPU", "block_hashes": [1, 2**64 - 1], "copies": [1, 2]}


def bad(**changes: object) -> bytes:
    doc = msgspec.to_builtins(SNAPSHOT)
    doc.update(changes)
    return msgspec.msgpack.encode(doc)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (encode_snapshot(SNAPSHOT)[:-4], "unreadable"),
        (b"", "unreadable"),
        (bad(schema="other/2"), "schema"),
        (
            bad(
                ranks=[
                    {
                        "dp_rank": 0,
                        "seq": 1,
                        "partial": False,
                        "tiers": [{"tier": "GPU", "block_hashes": [-1]}],
                    }
                ]
            ),
            "uint64",
        ),
        (
            bad(
                ranks=[
                    {
                        "dp_rank": 0,
                        "seq": 1,
                        "partial": False,
                        "tiers": [{"tier": "GPU", "block_hashes": [1], "copies": [1, 1]}],
                    }
                ]
            ),
            "copy counts",
        ),
        (bad(ranks="nope"), "unreadable"),
    ],
)
def test_bad_bodies_are_refused_with_a_reason(body: bytes, says: str) -> None:
    with pytest.raises(SnapshotError, match=says):
        decode_snapshot(body, "application/msgpack")


def test_another_pods_or_models_snapshot_is_refused() -> None:
    for pod, model, rank, says in (
        ("pod-b", "m", 0, "pod 'pod-a'"),
        ("pod-a", "x", 0, "model"),
        ("pod-a", "m", 2, "rank 2"),
    ):
        with pytest.raises(SnapshotError, match=says):
            check_snapshot_for(SNAPSHOT, pod, model, rank)
