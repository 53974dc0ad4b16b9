"""vLLM's endpoint rules, shared by publishers and subscribers: bind or connect, and the data-parallel
port offset (rank r of `tcp://host:P` uses `tcp://host:P+r`, for the PUB and the replay socket alike).
Pure string functions.
"""

from __future__ import annotations


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint has `*` or `::`, or is ipc:// / inproc://; else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def has_ephemeral_port(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*")


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's data-parallel offset, applied to both the PUB and the replay endpoint.

    rank 0 or no endpoint: unchanged; `inproc://X` -> `inproc://X_dp{rank}`; `tcp://host:P` ->
    `tcp://host:{P+rank}` (port 0 stays 0); anything else at rank > 0 (ipc://) raises ValueError.
    """
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base_addr, _, port_text = endpoint.rpartition(":")
        if port_text == "*":
            return endpoint  # NOTE: vLLM would fail on int("*"); an ephemeral port needs no offset.
        base_port = int(port_text)
        if base_port == 0:
            return endpoint
        return f"{base_addr}:{base_port + dp_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")
