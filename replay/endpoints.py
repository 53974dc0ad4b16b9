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


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not a ZMQ address kvindex can use (one phrase), or None when it is:
    tcp://HOST:PORT (PORT a number or `*`), ipc://PATH or inproc://NAME."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return f"{endpoint!r} is not a ZMQ address; expected tcp://HOST:PORT"
    if scheme != "tcp":
        return None if rest else f"{endpoint!r} names no {scheme} path"
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return f"{endpoint!r} has no port; expected tcp://HOST:PORT"
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        return f"{endpoint!r} has port {port!r}; expected a number from 0 to 65535 or *"
    return None
