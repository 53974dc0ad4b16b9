"""The write path's shell: settings, intake (poller callbacks -> per-pod queues), worker (sequence check,
replay, apply) and service (lifecycle, status, queries). Threads and ZMQ live here, nothing below."""

from kvindex.indexer.ingest.service import IngestService, IngestSettings, ModelRuntime

__all__ = ["IngestService", "IngestSettings", "ModelRuntime"]
