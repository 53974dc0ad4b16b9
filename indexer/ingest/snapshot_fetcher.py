"""Snapshot loads off the worker thread: a sidecar's `GET /v1/snapshot`, fetched and decoded on a small
thread pool with a timeout and a size cap, handed back through the pod's ordered queue (like a replay's
answer). A slow or dead sidecar delays only its own stream's load."""

from __future__ import annotations

import http.client
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from kvindex.indexer.snapshot import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    PodSnapshot,
    SnapshotError,
    decode_snapshot,
)

log = logging.getLogger("kvindex.indexer.ingest")


class SnapshotResult(msgspec.Struct, frozen=True):
    """A loaded snapshot, or why there is none: `outcome` is "ok", "unavailable" (no answer, an HTTP
    error, too large) or "invalid" (an answer that is no snapshot); `error` is one sentence."""

    snapshot: PodSnapshot | None
    outcome: str
    error: str | None = None
    num_bytes: int = 0


def fetch_snapshot(url: str, *, timeout_s: float, max_bytes: int) -> SnapshotResult:
    """GET the snapshot at `url` (msgpack asked for; JSON accepted) and decode it; never raises."""
    request = urllib.request.Request(
        url, headers={"Accept": f"{MSGPACK_CONTENT_TYPE}, {JSON_CONTENT_TYPE};q=0.5"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(max_bytes + 1)
            content_type = response.headers.get("Content-Type")
    except urllib.error.HTTPError as exc:
        return SnapshotResult(None, "unavailable", f"{url} answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return SnapshotResult(None, "unavailable", f"{url} could not be read ({reason})")
    if len(body) > max_bytes:
        return SnapshotResult(None, "unavailable", f"{url} sent more than {max_bytes} bytes")
    try:
        snapshot = decode_snapshot(body, content_type)
    except SnapshotError as exc:
        return SnapshotResult(None, "invalid", f"{url}: {exc}", len(body))
    return SnapshotResult(snapshot, "ok", None, len(body))


class SnapshotFetcher:
    """Runs `fetch_snapshot` for each request on `max_workers` threads; `on_result(key, result)` is
    called on a pool thread and must not block (hand the result to a queue)."""

    def __init__(
        self,
        on_result: Callable[[Hashable, SnapshotResult], None],
        *,
        timeout_s: float = 5.0,
        max_bytes: int = 256 << 20,
        max_workers: int = 4,
    ) -> None:
        self._on_result = on_result
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvindex-snapshot")
        self._stopped = False

    def request(self, key: Hashable, url: str) -> None:
        """Fetch `url` and report it under `key`; thread-safe. Ignored once stopped."""
        if self._stopped:
            return
        try:
            self._pool.submit(self._run, key, url)
        except RuntimeError:  # shut down meanwhile
            pass

    def stop(self) -> None:
        """Abandon queued loads; one already running ends within its timeout (its result is dropped)."""
        self._stopped = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: Hashable, url: str) -> None:
        result = fetch_snapshot(url, timeout_s=self._timeout_s, max_bytes=self._max_bytes)
        if self._stopped:
            return
        try:
            self._on_result(key, result)
        except Exception:
            log.exception("handing over the snapshot of %s failed", url)
