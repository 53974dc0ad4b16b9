"""Start-up shell of `kvindex serve`: say which pod hosts do not resolve, without holding anything up.

libzmq resolves a dialled host lazily and keeps retrying, so a typo in a host name shows only as a pod
that stays `disconnected`. A warning naming the pod and the host says why. Not fatal: in Kubernetes a
pod's DNS name may appear after kvindex starts, and kvindex keeps dialling it.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
from collections.abc import Callable, Sequence

# Lookups in flight at once: enough for a large fleet behind a slow resolver, few enough to stay polite.
MAX_LOOKUP_THREADS = 8


def needs_lookup(host: str) -> bool:
    """False for IP literals (IPv6 with a zone too): nothing to resolve."""
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return True
    return False


def resolve_problem(host: str, port: int) -> str | None:
    """Why `host` does not resolve (the resolver's own words), or None when it does."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return None


def warn_unresolved_hosts(
    targets: Sequence[tuple[str, str, int]],
    warn: Callable[[str], None],
    *,
    max_threads: int = MAX_LOOKUP_THREADS,
) -> list[threading.Thread]:
    """Resolve every host of `targets` ((who, host, port): who names the pod and endpoint) on daemon
    threads, calling `warn` with one sentence per host that does not resolve; returns the threads (tests
    join them). Daemon threads, since a lookup cannot be cancelled and must not hold up a stop."""
    by_host: dict[str, list[str]] = {}
    ports: dict[str, int] = {}
    for who, host, port in targets:
        if needs_lookup(host):
            by_host.setdefault(host, []).append(who)
            ports.setdefault(host, port)
    work: queue.SimpleQueue[str] = queue.SimpleQueue()
    for host in by_host:
        work.put(host)

    def lookups() -> None:
        while True:
            try:
                host = work.get_nowait()
            except queue.Empty:
                return
            problem = resolve_problem(host, ports[host])
            if problem is not None:
                warn(_sentence(host, by_host[host], problem))

    threads = [
        threading.Thread(target=lookups, name=f"kvindex-dns-{i}", daemon=True)
        for i in range(min(max_threads, len(by_host)))
    ]
    for thread in threads:
        thread.start()
    return threads


def _sentence(host: str, whos: list[str], problem: str) -> str:
    named = ", ".join(whos[:3]) + (f" and {len(whos) - 3} more" if len(whos) > 3 else "")
    return (
        f"host {host!r} does not resolve ({problem}), used by {named}; kvindex keeps dialling it, "
        "so check the name if the pod stays disconnected"
    )


def log_unresolved_hosts(targets: Sequence[tuple[str, str, int]], logger: logging.Logger) -> None:
    """`warn_unresolved_hosts`, warning through `logger`."""
    warn_unresolved_hosts(targets, lambda sentence: logger.warning("%s", sentence))
