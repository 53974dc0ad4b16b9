"""The ingest pipeline's process-wide counters, shared by the poller and the workers: plain values behind
one lock (read at scrape time by api/metrics.py), plus "dropped, and logged once" for bad input."""

from __future__ import annotations

import logging
import threading

import msgspec
from kvindex.indexer.status import IngestCounters

log = logging.getLogger("kvindex.indexer.ingest")


class Counters:
    """IngestCounters behind a lock (several threads update them; `lock` + `values` for bulk updates)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = IngestCounters(events_applied={}, dropped={}, replays={})
        self._logged_once: set[str] = set()

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self.values, name, getattr(self.values, name) + n)

    def add_to(self, name: str, key: str, n: int = 1) -> None:
        with self.lock:
            table: dict[str, int] = getattr(self.values, name)
            table[key] = table.get(key, 0) + n

    def snapshot(self) -> IngestCounters:
        with self.lock:
            return msgspec.convert(msgspec.to_builtins(self.values), IngestCounters)

    def drop(self, reason: str, detail: str) -> None:
        """Count one dropped message or event under `reason`; log the first of each reason and source."""
        self.add_to("dropped", reason)
        self.log_once(f"drop:{reason}:{detail.split(':')[0]}", "dropped (%s): %s", reason, detail)

    def log_once(self, key: str, message: str, *args: object) -> None:
        # A lost race under the GIL only logs a line twice.
        if key not in self._logged_once:
            self._logged_once.add(key)
            log.warning(message, *args)
