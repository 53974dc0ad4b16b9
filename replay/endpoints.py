"""vLLM's endpoint rules, shared by publishers and subscribers: bind or connect, the data-parallel port
offset (rank r of `tcp://host:P` uses `tcp://host:P+r`, for the PUB and the replay socket alike), and the
syntax of a ZMQ address, checked before any socket exists (libzmq answers a malformed one with `Invalid
argument`, naming neither the pod nor what was expected). Pure string functions, no name resolution.
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


SCHEMES = ("tcp://", "ipc://", "inproc://")
EXPECTED = "expected tcp://HOST:PORT"


def endpoint_problem(endpoint: str, *, dial: bool) -> str | None:
    """What is wrong with `endpoint` as a ZMQ address, as the end of a sentence; None if it looks usable.

    `dial`: the endpoint is connected to (a pod's PUB or replay socket), so it needs a concrete host and a
    port in 1..65535. Otherwise it is bound, so `*` as host, and `*` or 0 as port (ephemeral), are fine too.
    tcp:// takes ZMQ's optional `SOURCE;` prefix and IPv6 in brackets; ipc:// and inproc:// need a name.
    """
    scheme = next((s for s in SCHEMES if endpoint.startswith(s)), None)
    if scheme is None:
        return f"is not a ZMQ address; {EXPECTED} (or ipc://PATH, inproc://NAME)"
    rest = endpoint[len(scheme) :]
    if scheme != "tcp://":
        return None if rest else f"names no {scheme[:-3]} path; {EXPECTED} or {scheme}NAME"
    # ZMQ's `tcp://SOURCE:PORT;HOST:PORT` dials from a given source address: the destination is what counts.
    address = rest.rpartition(";")[2]
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
    if not sep or not host:
        return f"has no {'host' if sep else 'port'}; {EXPECTED}"
    if any(c.isspace() for c in host) or "/" in host:
        return f"has a malformed host {host!r}; {EXPECTED}"
    if dial and host == "*":
        return f"cannot be dialled (`*` binds every interface); give the engine's address, {EXPECTED}"
    if port == "*" and not dial:
        return None
    if not port.isdigit() or int(port) > 65535:
        return f"has a malformed port {port!r}; {EXPECTED} with a port in 1..65535" + (
            "" if dial else " (or * for any free port)"
        )
    if dial and int(port) == 0:
        return f"cannot be dialled on port 0; {EXPECTED} with the engine's port"
    return None


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) a tcp:// endpoint dials, brackets removed; None for ipc://, inproc:// or a wildcard."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(";")[2].rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or host == "*" or not port.isdigit():
        return None
    return host, int(port)
