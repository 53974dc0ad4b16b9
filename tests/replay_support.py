"""Helpers for the replay tests: vLLM's recorded vectors, wire objects rebuilt from them, socket receives
under a timeout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import zmq
from kvindex.replay import wire

VECTORS_DIR = Path(__file__).resolve().parent / "vectors"
RECV_TIMEOUT_MS = 5000


def load_vectors(name: str) -> dict[str, Any]:
    with open(VECTORS_DIR / name) as f:
        data: dict[str, Any] = json.load(f)
    return data


def recorded_hash(value: Any) -> int | bytes:
    """The vectors write raw-bytes hashes as {"bytes_hex": ...}."""
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes_hex"])
    assert isinstance(value, int)
    return value


def wire_event_from_record(record: dict[str, Any]) -> wire.WireEvent:
    """Rebuild the wire object vLLM encoded, from its recorded builtins form."""
    fields = {key: value for key, value in record.items() if key != "type"}
    if "block_hashes" in fields:
        fields["block_hashes"] = [recorded_hash(h) for h in fields["block_hashes"]]
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = recorded_hash(fields["parent_block_hash"])
    kind = record["type"]
    if kind == "BlockStored":
        return wire.BlockStored(**fields)
    if kind == "BlockRemoved":
        return wire.BlockRemoved(**fields)
    assert kind == "AllBlocksCleared", kind
    return wire.AllBlocksCleared()


def recv_frames(sock: zmq.Socket[bytes], timeout_ms: int = RECV_TIMEOUT_MS) -> list[bytes]:
    """One multipart message, or an AssertionError after `timeout_ms`."""
    assert sock.poll(timeout_ms, zmq.POLLIN), "no message before the timeout"
    return sock.recv_multipart(zmq.NOBLOCK)


def nothing_arrives(sock: zmq.Socket[bytes], timeout_ms: int) -> bool:
    return not sock.poll(timeout_ms, zmq.POLLIN)


def hexes(frames: list[bytes]) -> list[str]:
    return [frame.hex() for frame in frames]
