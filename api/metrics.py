"""Prometheus metrics (`kvindex_*`), served by `GET /metrics`.

Ingest metrics are read from the service at scrape time (counters, pod statuses, index sizes), so the
write path never touches a metric object; the per-pod families are written as text (pod_metrics.py). Request-path metrics (latency, matched
blocks, status codes) are owned by the API and live in a per-app registry, so tests can build many apps.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from typing import Protocol

import msgspec
from kvindex.api.pod_metrics import pod_exposition
from kvindex.indexer.status import (
    IngestCounters,
    PodStatus,
)
from kvindex.indexer.store import StoreUnavailable
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SCORE_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MATCHED_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class _IndexStats(Protocol):
    def num_keys(self) -> int: ...
    def num_entries(self) -> int: ...


class _ModelSettings(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_algo(self) -> str: ...


class _ModelRuntime(Protocol):
    @property
    def index(self) -> _IndexStats: ...
    @property
    def config(self) -> _ModelSettings: ...


class MetricsSource(Protocol):
    """What the collector reads; `kvindex.indexer.ingest.IngestService` provides it."""

    def counters(self) -> IngestCounters: ...
    def pod_statuses(self) -> list[PodStatus]: ...
    def model_names(self) -> list[str]: ...
    def model(self, name: str) -> _ModelRuntime | None: ...


# Every IngestCounters field -> (metric name, help, label of a per-key field or None). Exported as a
# counter, so the exposition name ends in `_total`. A field missing here is still exported under
# kvindex_ingest_<field> (tests/api/test_metrics.py walks the struct and insists it is listed here).
COUNTER_METRICS: dict[str, tuple[str, str, str | None]] = {
    "events_applied": ("kvindex_events_applied", "KV events applied to the index, by event type.", "type"),
    "dropped": ("kvindex_events_dropped", "Events or messages dropped, by reason.", "reason"),
    "gaps": ("kvindex_gaps", "Sequence gaps detected in pod event streams.", None),
    "history_lost": (
        "kvindex_history_lost",
        "Gaps the engine's replay ring no longer covered (the pod's entries were cleared; it resyncs).",
        None,
    ),
    "duplicates": (
        "kvindex_duplicates",
        "Live batches skipped as already applied (normal right after a replay).",
        None,
    ),
    "replays": ("kvindex_replays", "Replay requests to engines, by outcome.", "outcome"),
    "restarts": ("kvindex_restarts", "Engine restarts detected (sequence went back).", None),
    "hash_mismatches": (
        "kvindex_hash_mismatches",
        "Sampled BlockStored events whose recomputed hashes differ.",
        None,
    ),
    "unknown_parents": (
        "kvindex_unknown_parents",
        "BlockStored events whose parent block the index does not hold.",
        None,
    ),
    "block_size_mismatches": (
        "kvindex_block_size_mismatches",
        "BlockStored events whose block size differs from the model's.",
        None,
    ),
    "non_prefix_group_events": (
        "kvindex_non_prefix_group_events",
        "Events of KV-cache groups kept out of prefix scoring.",
        None,
    ),
    "snapshots": (
        "kvindex_snapshot_loads",
        "Sidecar snapshot loads, by outcome (anything but ok fell back to the replay ring).",
        "outcome",
    ),
}

# Label values exported at 0 before they first happen, so rate() and alerts see the series from the start.
KNOWN_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "events_applied": ("BlockStored", "BlockRemoved", "AllBlocksCleared"),
    # "unavailable": a gap or join on a stream with no replay endpoint configured.
    "replays": ("ok", "history_lost", "timeout", "error", "unavailable", "gave_up"),
    "snapshots": ("ok", "unavailable", "invalid", "wrong_pod"),
}


def ingest_counter_families(counters: IngestCounters) -> list[CounterMetricFamily]:
    """One counter family per IngestCounters field, in field order."""
    families = []
    for field in msgspec.structs.fields(IngestCounters):
        value = getattr(counters, field.name)
        name, help_text, label = COUNTER_METRICS.get(
            field.name, (f"kvindex_ingest_{field.name}", f"IngestCounters.{field.name}", "key")
        )
        if isinstance(value, dict):
            values = {key: 0 for key in KNOWN_LABEL_VALUES.get(field.name, ())} | value
            families.append(_labelled_counter(name, help_text, label or "key", values))
        else:
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], value)
            families.append(family)
    return families


def ingest_families(source: MetricsSource) -> tuple[list[Metric], list[PodStatus]]:
    """The service's families at one reading (counters, store_up, model and index sizes), and that
    reading's pod statuses for `pod_exposition` ([] when the store did not answer: store_up is 0)."""
    families: list[Metric] = list(ingest_counter_families(source.counters()))
    store_up = GaugeMetricFamily(
        "kvindex_store_up", "1 if the index's store answered this scrape (0: unreachable)."
    )
    try:
        statuses = source.pod_statuses()
    except StoreUnavailable:
        store_up.add_metric([], 0.0)
        families.append(store_up)
        return families, []  # every family below reads the store
    store_up.add_metric([], 1.0)
    families.append(store_up)

    info = GaugeMetricFamily(
        "kvindex_model_info",
        "Always 1; labels are a served model's hash settings (compare them with the engines').",
        labels=["model", "block_size", "hash_algo"],
    )
    keys = GaugeMetricFamily("kvindex_index_keys", "Block keys in the index.", labels=["model"])
    entries = GaugeMetricFamily(
        "kvindex_index_entries", "(block key, pod) entries in the index.", labels=["model"]
    )
    for model_name in source.model_names():
        runtime = source.model(model_name)
        if runtime is None:
            continue
        config = runtime.config
        info.add_metric([model_name, str(config.block_size), config.hash_algo], 1.0)
        try:
            keys.add_metric([model_name], runtime.index.num_keys())
            entries.add_metric([model_name], runtime.index.num_entries())
        except StoreUnavailable:
            pass  # the store went away between two reads: these two are absent this scrape
    families.extend((info, keys, entries))
    return families, statuses


class Collected(Collector):
    """Families already built, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _labelled_counter(name: str, help_text: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for label_value, count in sorted(values.items()):
        family.add_metric([label_value], count)
    return family


def kvindex_version() -> str:
    """The installed distribution's version (pyproject takes it from kvindex.__version__)."""
    try:
        return installed_version("kvindex")
    except PackageNotFoundError:
        return "unknown"


class RequestMetrics:
    """The API's own metrics, in a registry private to one app."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.build_info = Gauge(
            "kvindex_build_info",
            "Always 1; labels name the kvindex version and the Python running it.",
            labelnames=["version", "python"],
            registry=registry,
        )
        self.build_info.labels(kvindex_version(), platform.python_version()).set(1)
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
        self.prompt_blocks = Counter(
            "kvindex_score_prompt_blocks",
            "Full blocks of token-id score prompts: hashed=true if hashed (or known to the hash memo), "
            "false if left unhashed because an earlier block is held by no pod.",
            labelnames=["hashed"],
            registry=registry,
        )
        self._blocks_hashed = self.prompt_blocks.labels("true")
        self._blocks_unhashed = self.prompt_blocks.labels("false")
        self.requests = Counter(
            "kvindex_http_requests",
            "HTTP requests by route and status code.",
            labelnames=["route", "status"],
            registry=registry,
        )

    def observe_score(self, started: float, best_matched_blocks: int) -> None:
        self.score_latency.observe(time.perf_counter() - started)
        self.matched_blocks.observe(best_matched_blocks)

    def observe_prompt_blocks(self, hashed: int, unhashed: int) -> None:
        """One token prompt's full blocks: those hashed (or known to the memo), those left unhashed."""
        if hashed:
            self._blocks_hashed.inc(hashed)
        if unhashed:
            self._blocks_unhashed.inc(unhashed)


class MetricsScraper:
    """`GET /metrics` of one app: its request metrics (a registry private to the app, so tests can build
    many apps), then the service's families read at scrape time (the write path never touches a metric
    object), then the per-pod families written as text (pod_metrics.py)."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = RequestMetrics(self.registry)

    def scrape(self) -> bytes:
        families, statuses = ingest_families(self._source)
        return b"".join(
            (
                generate_latest(self.registry),
                generate_latest(Collected(families)),
                pod_exposition(statuses).encode("utf-8"),
            )
        )
