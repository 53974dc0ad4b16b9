"""When to hand freed heap pages back to the OS during ingest.

NOTE: payloads (a few KB each) queue up while a worker lags the poller and are freed once applied, but the
heap cannot shrink past the index's own later allocations, so a burst's payload pages stay resident
(measured: a large share of the service's RSS after one big burst). Releasing them (glibc's malloc_trim,
supplied by the process shell in cli/process.py) takes a few ms with the GIL released, so it runs only
after a large drained burst, or once ingest has gone idle.
"""

from __future__ import annotations

from collections.abc import Callable

# Payload bytes handled between two releases while ingest is busy.
RELEASE_AFTER_BYTES = 32 << 20


class HeapRelease:
    """Counts payload bytes handled and calls `release` when a burst has drained (worker) or when ingest
    went idle with bytes pending (watch thread). Without `release` it only counts."""

    def __init__(self, release: Callable[[], object] | None, after_bytes: int = RELEASE_AFTER_BYTES) -> None:
        self._release = release
        self._after_bytes = after_bytes
        # Shared by the workers and the watch thread: a lost update under the GIL only delays a release.
        self.pending_bytes = 0
        self._pending_at_last_tick = 0

    def note(self, num_bytes: int) -> None:
        self.pending_bytes += num_bytes

    def after_drain(self, idle: bool) -> None:
        """A worker finished a drain; `idle`: nothing is queued anywhere."""
        if self.pending_bytes >= self._after_bytes and idle:
            self._do_release()

    def tick(self, idle: bool) -> None:
        """The watch thread's periodic check: bytes pending and nothing handled since the last tick."""
        pending = self.pending_bytes
        if pending and pending == self._pending_at_last_tick and idle:
            self._do_release()
            pending = 0
        self._pending_at_last_tick = pending

    def _do_release(self) -> None:
        self.pending_bytes = 0
        if self._release is not None:
            self._release()
