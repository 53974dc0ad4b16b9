"""The write path's shell: settings, intake (poller callbacks -> per-pod queues), worker (sequence check,
replay, filter, apply) and service (lifecycle, status, queries). Threads and ZMQ live here, not below."""

from kvindex.indexer.ingest.service import IngestService
from kvindex.indexer.ingest.settings import DEFAULT_SETTINGS, IngestSettings

__all__ = ["DEFAULT_SETTINGS", "IngestService", "IngestSettings"]
