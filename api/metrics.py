"""Prometheus metrics (`kvindex_*`), served by `GET /metrics`.

Ingest metrics are read from the service at scrape time by a custom Collector (counters, pod statuses,
index sizes), so the write path never touches a metric object. Request-path metrics (latency, matched
blocks, status codes) are owned by the API and live in a per-app registry, so tests can build many apps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from kvindex.indexer.status import (
    STATE_DISCONNECTED,
    STATE_HASH_MISMATCH,
    STATE_LIVE,
    STATE_REPLAYING,
    STATE_RESYNCING,
    STATE_SILENT,
    IngestCounters,
    PodStatus,
)
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

POD_STATES = (
    STATE_LIVE,
    STATE_REPLAYING,
    STATE_RESYNCING,
    STATE_SILENT,
    STATE_HASH_MISMATCH,
    STATE_DISCONNECTED,
)

SCORE_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MATCHED_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class _IndexStats(Protocol):
    def num_keys(self) -> int: ...
    def num_entries(self) -> int: ...


class _ModelRuntime(Protocol):
    @property
    def index(self) -> _IndexStats: ...


class MetricsSource(Protocol):
    """What the collector reads; `kvindex.indexer.ingest.IngestService` provides it."""

    def counters(self) -> IngestCounters: ...
    def pod_statuses(self) -> list[PodStatus]: ...
    def model_names(self) -> list[str]: ...
    def model(self, name: str) -> _ModelRuntime | None: ...


class IngestCollector(Collector):
    """Turns the service's plain counters and statuses into metric families at scrape time."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        # No eager describe: collecting calls into the service, which registration must not do.
        return []

    def collect(self) -> Iterator[Metric]:
        counters = self._source.counters()
        yield _labelled_counter(
            "kvindex_events_applied",
            "KV events applied to the index, by event type.",
            "type",
            counters.events_applied,
        )
        yield _labelled_counter(
            "kvindex_events_dropped", "Events or messages dropped, by reason.", "reason", counters.dropped
        )
        yield _labelled_counter(
            "kvindex_replays", "Replay requests to engines, by outcome.", "outcome", counters.replays
        )
        for name, help_text, value in (
            ("kvindex_gaps", "Sequence gaps detected in pod event streams.", counters.gaps),
            ("kvindex_restarts", "Engine restarts detected (sequence went back).", counters.restarts),
            (
                "kvindex_hash_mismatches",
                "Sampled BlockStored events whose recomputed hashes differ.",
                counters.hash_mismatches,
            ),
            (
                "kvindex_block_size_mismatches",
                "BlockStored events whose block size differs from the model's.",
                counters.block_size_mismatches,
            ),
            (
                "kvindex_unknown_parents",
                "BlockStored events whose parent block the index does not hold.",
                counters.unknown_parents,
            ),
            (
                "kvindex_non_prefix_group_events",
                "Events of KV-cache groups kept out of prefix scoring.",
                counters.non_prefix_group_events,
            ),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], value)
            yield family

        statuses = self._source.pod_statuses()
        age = GaugeMetricFamily(
            "kvindex_pod_last_event_age_seconds",
            "Seconds since the pod's last event (absent before its first).",
            labels=["pod", "dp_rank", "model"],
        )
        state = GaugeMetricFamily(
            "kvindex_pod_state",
            "Pod stream state, one-hot over the states.",
            labels=["pod", "dp_rank", "model", "state"],
        )
        blocks = GaugeMetricFamily(
            "kvindex_pod_blocks", "Blocks the index holds for the pod.", labels=["pod", "dp_rank", "model"]
        )
        for status in statuses:
            stream = [status.pod, str(status.dp_rank), status.model]
            if status.last_event_age_s is not None:
                age.add_metric(stream, status.last_event_age_s)
            blocks.add_metric(stream, status.blocks)
            for name in POD_STATES:
                state.add_metric([*stream, name], 1.0 if status.state == name else 0.0)
        yield age
        yield state
        yield blocks

        keys = GaugeMetricFamily("kvindex_index_keys", "Block keys in the index.", labels=["model"])
        entries = GaugeMetricFamily(
            "kvindex_index_entries", "(block key, pod) entries in the index.", labels=["model"]
        )
        for model_name in self._source.model_names():
            runtime = self._source.model(model_name)
            if runtime is None:
                continue
            keys.add_metric([model_name], runtime.index.num_keys())
            entries.add_metric([model_name], runtime.index.num_entries())
        yield keys
        yield entries


def _labelled_counter(name: str, help_text: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for label_value, count in sorted(values.items()):
        family.add_metric([label_value], count)
    return family


class RequestMetrics:
    """The API's own metrics, in a registry private to one app."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.score_latency = Histogram(
            "kvindex_score_latency_seconds",
            "Time to answer POST /v1/score (decode, hash, lookup, score, encode).",
            buckets=SCORE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.matched_blocks = Histogram(
            "kvindex_score_matched_blocks",
            "Matched blocks of the best pod per answered score request.",
            buckets=MATCHED_BLOCK_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "kvindex_http_requests",
            "HTTP requests by route and status code.",
            labelnames=["route", "status"],
            registry=registry,
        )

    def observe_score(self, started: float, best_matched_blocks: int) -> None:
        self.score_latency.observe(time.perf_counter() - started)
        self.matched_blocks.observe(best_matched_blocks)


def build_registry(source: MetricsSource) -> tuple[CollectorRegistry, RequestMetrics]:
    """A fresh registry holding the ingest collector and the request metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IngestCollector(source))
    return registry, RequestMetrics(registry)
